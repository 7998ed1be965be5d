"""Where a command's CPU goes, by kind of process: the test suite's, by default.

Samples /proc once, runs the command and samples every ``--interval-s`` while it
runs: each process's CPU time (utime + stime) at its last sample, less what it
had at the first sample if it was running before the command, keyed by pid and
start time, its kind from its command line (``kind_of``). At the end it prints
CPU seconds per kind, how many processes spent any, and the box's busy CPU
seconds over the run (/proc/stat) beside the command's wall time. Processes
that live less than one interval are missed (their CPU is in the busy figure
only): read the kinds, not the last second.

``--by-file``: the CPU by test file instead. The command's pytest processes load the plugin
``benchmarks/_suite_files.py`` (added to the command line), which writes down when each test
process starts each file; every process's CPU between two samples goes to the file its
nearest pytest ancestor was running then (its ancestor found at first sight, so a child
that outlives its parent keeps it). A process with no pytest ancestor (a daemon such as
``ray start``'s, or the box's own) is "not under a test".

Run: python benchmarks/suite_cpu.py [--interval-s 0.5] [--by-file [--top 40]] [-- COMMAND ...]
     (default command: .venv/bin/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder)
"""

from __future__ import annotations

import argparse
import bisect
import os
import re
import subprocess
import sys
import tempfile
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


PYTEST = re.compile(KINDS[0][1] + "|" + KINDS[1][1])  # a pytest process (worker or not)
SAMPLER = re.compile(r"(?:^|[\s/])suite_cpu\.py\b")  # this file, run as a script


def sample(
    seen: dict[tuple[int, str], list],
    ticks_per_s: int,
    before: bool = False,
    deltas: dict[int | None, float] | None = None,
) -> None:
    """One pass over /proc: every process's command line and CPU seconds, and at first
    sight its CPU seconds until then if ``before`` (the pass before the command), else 0:
    ``[cmdline, cpu_s, base_s, owner]``. ``owner`` is the pid of its nearest pytest
    ancestor (itself if it is one; None if it has none), found at first sight; with
    ``deltas``, the CPU each owner's processes spent since the last pass is added to it."""
    ppids: dict[int, int] = {}
    spent: dict[tuple[int, str], float] = {}  # this pass's CPU, by process
    new: list[tuple[int, str]] = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
            fields = stat[stat.rindex(")") + 2 :].split()
            cpu_s = (int(fields[11]) + int(fields[12])) / ticks_per_s
            key = (int(name), fields[19])  # pid and start time: pids are reused
            ppids[key[0]] = int(fields[1])
            if key not in seen:
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
                base_s = cpu_s if before else 0.0
                seen[key] = [cmdline, base_s, base_s, None]  # cpu_s set just below
                new.append(key)
            row = seen[key]
            spent[key] = cpu_s - row[1]
            row[1] = cpu_s
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile, or a kernel thread without a command line
    if new:
        command_of = {pid: row[0] for (pid, _), row in seen.items() if pid in ppids}
        for key in new:
            seen[key][3] = _pytest_ancestor(key[0], ppids, command_of)
    if deltas is not None:
        for key, cpu_s in spent.items():
            if cpu_s > 0:
                owner = seen[key][3]
                deltas[owner] = deltas.get(owner, 0.0) + cpu_s


def _pytest_ancestor(pid: int, ppids: dict[int, int], command_of: dict[int, str]) -> int | None:
    """``pid`` or its nearest ancestor that is a pytest process (not a sampler of this file,
    whose command line names pytest after ``--``), or None."""
    for _ in range(64):
        command = command_of.get(pid, "")
        if PYTEST.search(command) and not SAMPLER.search(command):
            return pid
        pid = ppids.get(pid, 0)
        if pid <= 1:
            return None
    return None


def by_kind(seen: dict[tuple[int, str], list]) -> tuple[Counter, Counter]:
    cpu, count = Counter(), Counter()
    for cmdline, cpu_s, base_s, _owner in seen.values():
        if not cmdline.strip() or cpu_s <= base_s:
            continue  # kernel threads (in the box's busy figure only), or idle meanwhile
        kind = kind_of(cmdline)
        cpu[kind] += cpu_s - base_s
        count[kind] += 1
    return cpu, count


NOT_UNDER_A_TEST = "(not under a test)"


def by_file(samples: list[tuple[float, dict]], timeline_path: str) -> tuple[Counter, Counter]:
    """CPU seconds per test file (and the files' wall seconds in their processes) from the
    passes' per-owner CPU and the plugin's timeline."""
    starts: dict[int, list[tuple[float, str]]] = {}
    with open(timeline_path) as f:
        for line in f:
            pid, t, file = line.split(maxsplit=2)
            starts.setdefault(int(pid), []).append((float(t), file.strip()))
    times = {pid: [t for t, _ in rows] for pid, rows in starts.items()}
    cpu, wall = Counter(), Counter()
    for rows in starts.values():
        for (t0, file), (t1, _) in zip(rows, [*rows[1:], (samples[-1][0], "")], strict=True):
            wall[file] += max(0.0, t1 - t0)
    for t, deltas in samples:
        for owner, cpu_s in deltas.items():
            if owner is None:
                cpu[NOT_UNDER_A_TEST] += cpu_s
            elif owner not in starts:
                cpu["(pytest, outside any test file)"] += cpu_s
            else:
                i = bisect.bisect_right(times[owner], t) - 1
                cpu[starts[owner][i][1] if i >= 0 else "(pytest, before its first test)"] += cpu_s
    return cpu, wall


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--interval-s", type=float, default=0.5)
    parser.add_argument("--by-file", action="store_true", help="CPU by test file")
    parser.add_argument("--top", type=int, default=40, help="--by-file: the files listed")
    parser.add_argument("command", nargs="*", help="the command (after --)")
    args = parser.parse_args()
    command = args.command or DEFAULT_COMMAND
    env = None
    if args.by_file:
        if "pytest" not in command:
            parser.error("--by-file needs a pytest command (python -m pytest ...)")
        at = command.index("pytest") + 1
        command = [*command[:at], "-p", "benchmarks._suite_files", *command[at:]]
        timeline = tempfile.NamedTemporaryFile(prefix="suite-files-", delete=False)
        timeline.close()
        repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        python_path = os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH")) if p)
        env = {**os.environ, "TANDEM_SUITE_FILES": timeline.name, "PYTHONPATH": python_path}
    ticks_per_s = os.sysconf("SC_CLK_TCK")
    seen: dict[tuple[int, str], list] = {}
    samples: list[tuple[float, dict]] = []
    sample(seen, ticks_per_s, before=True)
    busy0, start = box_busy_s(), time.monotonic()
    proc = subprocess.Popen(command, env=env)
    while proc.poll() is None:
        deltas: dict = {}
        sample(seen, ticks_per_s, deltas=deltas if args.by_file else None)
        samples.append((time.monotonic(), deltas))
        time.sleep(args.interval_s)
    wall_s, busy_s = time.monotonic() - start, box_busy_s() - busy0
    cpu, count = by_kind(seen)
    total = sum(cpu.values())
    print(f"suite_cpu: {' '.join(command)} (exit {proc.returncode})")
    print(f"machine: {machine()}")
    print(f"wall {wall_s:.0f} s, box busy {busy_s:.0f} CPU-s, sampled processes {total:.0f} CPU-s")
    if args.by_file:
        files, walls = by_file(samples, timeline.name)
        os.unlink(timeline.name)
        print("| test file | CPU s | share | wall s in its process |")
        print("|---|---:|---:|---:|")
        for file, cpu_s in files.most_common(args.top):
            share = cpu_s / total if total else 0.0
            print(f"| {file} | {cpu_s:.0f} | {share:.1%} | {walls.get(file, 0.0):.0f} |")
        rest = files.most_common()[args.top :]
        if rest:
            print(f"| ({len(rest)} more files) | {sum(c for _, c in rest):.0f} | | |")
        return proc.returncode
    print("| kind | CPU s | share | processes | CPU s each |")
    print("|---|---:|---:|---:|---:|")
    for kind, cpu_s in cpu.most_common():
        share = cpu_s / total if total else 0.0
        print(f"| {kind} | {cpu_s:.0f} | {share:.1%} | {count[kind]} | {cpu_s / count[kind]:.1f} |")
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
