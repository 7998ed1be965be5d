"""Who used the box's cores over a window: the whole box (/proc/stat), the
engine processes (/proc/<pid>/stat), this process (the gateway runs in it:
``time.process_time``) and the waited-for children (the client process:
``RUSAGE_CHILDREN``). What is left of the box's busy time is everyone
else's: the other sessions' jobs, Ray's daemons.

    acct = CpuAccount(engine_pids)
    ...run something...
    figures = acct.stop()   # cores busy on average, per party, over the window
"""

from __future__ import annotations

import os
import resource
import statistics
import time

_TICK = os.sysconf("SC_CLK_TCK")


def box_busy_s() -> float:
    """CPU seconds every core of the box spent busy (not idle, not iowait) since boot."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    # user nice system idle iowait irq softirq steal [guest guest_nice: inside user]
    busy = sum(fields[:8]) - fields[3] - fields[4]
    return busy / _TICK


def pid_cpu_s(pid: int) -> float:
    """User + system CPU seconds of ``pid`` so far (0 when it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _TICK


def children_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


class CpuAccount:
    def __init__(self, engine_pids: list[int]) -> None:
        self.pids = list(engine_pids)
        self.t0 = time.monotonic()
        self.box0 = box_busy_s()
        self.engines0 = [pid_cpu_s(p) for p in self.pids]
        self.self0 = time.process_time()
        self.children0 = children_cpu_s()

    def stop(self) -> dict[str, float]:
        """Average cores busy over the window: ``box``, ``engines`` (all of
        them), ``gateway`` (this process), ``client`` (waited children) and
        ``others`` (the rest of the box, never below 0); ``wall_s``."""
        wall = time.monotonic() - self.t0
        box = box_busy_s() - self.box0
        engines = sum(pid_cpu_s(p) - c for p, c in zip(self.pids, self.engines0))
        gateway = time.process_time() - self.self0
        client = children_cpu_s() - self.children0
        return {
            "wall_s": wall,
            "box": box / wall,
            "engines": engines / wall,
            "gateway": gateway / wall,
            "client": client / wall,
            "others": max(0.0, box - engines - gateway - client) / wall,
        }


def cpu_line(cpu: dict) -> str:
    parts = ("box", "engines", "gateway", "client", "others")
    return ", ".join(f"{k} {cpu[k]:.2f}" for k in parts) + f" over {cpu['wall_s']:.1f} s"


def cpu_table(reals: dict, sims: dict) -> str:
    """Measured cores per party, and the engines' CPU seconds against the
    simulator's solo work (the profile's steps at its threads)."""
    lines = [
        "| config | box | engines | gateway | client | others | engine CPU s measured "
        "| engine CPU s simulated |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n, real in reals.items():
        c = real["cpu"]
        lines.append(
            f"| {n} | {c['box']:.2f} | {c['engines']:.2f} | {c['gateway']:.2f} "
            f"| {c['client']:.2f} | {c['others']:.2f} | {c['engines'] * c['wall_s']:.1f} "
            f"| {sims[n].get('engine_cpu_s', 0.0):.1f} |"
        )
    return "\n".join(lines)


def median_cpu(reals: dict[str, list[dict]]) -> dict[str, dict]:
    """Per configuration, each CPU figure's median over its rounds (as one run)."""
    out = {}
    for n, runs in reals.items():
        keys = runs[0]["cpu"]
        out[n] = {"cpu": {k: statistics.median(r["cpu"][k] for r in runs) for k in keys}}
    return out
