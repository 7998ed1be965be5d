"""Where a command's CPU goes, by kind of process: the test suite's, by default.

Samples /proc once, runs the command and samples every ``--interval-s`` while it
runs: each process's CPU time (utime + stime) at its last sample, less what it
had at the first sample if it was running before the command, keyed by pid and
start time, its kind from its command line (``kind_of``). At the end it prints
CPU seconds per kind, how many processes spent any, and the box's busy CPU
seconds over the run (/proc/stat) beside the command's wall time. Processes
that live less than one interval are missed (their CPU is in the busy figure
only): read the kinds, not the last second.

Run: python benchmarks/suite_cpu.py [--interval-s 0.5] [-- COMMAND ...]
     (default command: .venv/bin/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder)
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._cpu_account import box_busy_s  # noqa: E402
from benchmarks._machine import machine  # noqa: E402

DEFAULT_COMMAND = [
    ".venv/bin/python", "-m", "pytest", "-q", "-n", "2", "--dist", "loadfile",
    "--no-loadscope-reorder", "-p", "no:cacheprovider",
]  # fmt: skip

# (kind, pattern on the command line): the first that matches names the process
KINDS = [
    ("pytest worker", r"exec\(eval\(sys\.stdin\.readline\(\)\)\)"),
    ("pytest", r"-m pytest\b"),
    ("ray worker (actors: engines)", r"default_worker\.py|^ray::"),
    ("ray gcs", r"gcs_server"),
    ("ray raylet", r"/raylet\b"),
    ("ray dashboard", r"dashboard/dashboard\.py"),
    ("ray dashboard agent", r"dashboard/agent\.py"),
    ("ray runtime env agent", r"runtime_env/agent"),
    ("ray log monitor", r"log_monitor\.py"),
    ("ray monitor", r"autoscaler/_private/monitor\.py"),
    ("resolve child (torch)", r"tandem\.workers\.checkpoints\.resolve"),
    ("tandem gateway / cli", r"-m tandem\.cluster\b|bin/tandem\b|--serve gateway"),
    ("forkserver child", r"multiprocessing\.(forkserver|spawn)"),
    ("triton aot", r"triton_aot"),
    ("other python", r"python"),
]


def kind_of(cmdline: str) -> str:
    """The kind of a process from its command line (NULs as spaces)."""
    for kind, pattern in KINDS:
        if re.search(pattern, cmdline):
            return kind
    return "other"


def sample(seen: dict[tuple[int, str], list], ticks_per_s: int, before: bool = False) -> None:
    """One pass over /proc: every process's command line and CPU seconds, and at first
    sight its CPU seconds until then if ``before`` (the pass before the command), else 0:
    ``[cmdline, cpu_s, base_s]``."""
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
            fields = stat[stat.rindex(")") + 2 :].split()
            cpu_s = (int(fields[11]) + int(fields[12])) / ticks_per_s
            key = (int(name), fields[19])  # pid and start time: pids are reused
            if key not in seen:
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
                seen[key] = [cmdline, cpu_s, cpu_s if before else 0.0]
            else:
                seen[key][1] = cpu_s
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile, or a kernel thread without a command line


def by_kind(seen: dict[tuple[int, str], list]) -> tuple[Counter, Counter]:
    cpu, count = Counter(), Counter()
    for cmdline, cpu_s, base_s in seen.values():
        if not cmdline.strip() or cpu_s <= base_s:
            continue  # kernel threads (in the box's busy figure only), or idle meanwhile
        kind = kind_of(cmdline)
        cpu[kind] += cpu_s - base_s
        count[kind] += 1
    return cpu, count


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--interval-s", type=float, default=0.5)
    parser.add_argument("command", nargs="*", help="the command (after --)")
    args = parser.parse_args()
    command = args.command or DEFAULT_COMMAND
    ticks_per_s = os.sysconf("SC_CLK_TCK")
    seen: dict[tuple[int, str], list] = {}
    sample(seen, ticks_per_s, before=True)
    busy0, start = box_busy_s(), time.monotonic()
    proc = subprocess.Popen(command)
    while proc.poll() is None:
        sample(seen, ticks_per_s)
        time.sleep(args.interval_s)
    wall_s, busy_s = time.monotonic() - start, box_busy_s() - busy0
    cpu, count = by_kind(seen)
    total = sum(cpu.values())
    print(f"suite_cpu: {' '.join(command)} (exit {proc.returncode})")
    print(f"machine: {machine()}")
    print(f"wall {wall_s:.0f} s, box busy {busy_s:.0f} CPU-s, sampled processes {total:.0f} CPU-s")
    print("| kind | CPU s | share | processes | CPU s each |")
    print("|---|---:|---:|---:|---:|")
    for kind, cpu_s in cpu.most_common():
        share = cpu_s / total if total else 0.0
        print(f"| {kind} | {cpu_s:.0f} | {share:.1%} | {count[kind]} | {cpu_s / count[kind]:.1f} |")
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
