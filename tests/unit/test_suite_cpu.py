"""benchmarks/suite_cpu.py: the kinds of the processes a test-suite run starts, and the
sampler over this process's own /proc entry."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from benchmarks.suite_cpu import NOT_UNDER_A_TEST, by_file, by_kind, kind_of, sample


@pytest.mark.parametrize(
    ("cmdline", "kind"),
    [
        ("/x/.venv/bin/python -u -c import sys;exec(eval(sys.stdin.readline())) ", "pytest worker"),
        ("/x/.venv/bin/python -m pytest -q -n 2 ", "pytest"),
        ("/x/python3.11 /x/ray/_private/workers/default_worker.py --node-ip-address=1", "ray worker (actors: engines)"),
        ("/x/ray/core/src/ray/gcs/gcs_server --log_dir=/tmp", "ray gcs"),
        ("/x/ray/core/src/ray/raylet/raylet --raylet_socket_name=/tmp/s", "ray raylet"),
        ("/x/python -u /x/ray/dashboard/agent.py --node-ip-address=1", "ray dashboard agent"),
        ("/x/python /x/ray/dashboard/dashboard.py --host=1", "ray dashboard"),
        ("/x/python -u /x/ray/_private/runtime_env/agent/main.py ", "ray runtime env agent"),
        ("/x/python -u /x/ray/_private/log_monitor.py ", "ray log monitor"),
        ("/x/python -u /x/ray/autoscaler/_private/monitor.py ", "ray monitor"),
        ("/x/python -m tandem.workers.checkpoints.resolve tiny ", "resolve child (torch)"),
        ("/x/python -m tandem.cluster serve --model tiny ", "tandem gateway / cli"),
        ("/x/python -B -c from multiprocessing.forkserver import main; main(3) ", "forkserver child"),
        ("/x/python -m tests.kernels.triton_aot --json ", "triton aot"),
        ("/x/python somescript.py ", "other python"),
        ("/usr/bin/helm template x ", "other"),
    ],
)  # fmt: skip
def test_kinds(cmdline, kind):
    assert kind_of(cmdline) == kind


def test_the_sampler_sees_this_process_and_keeps_its_last_cpu_time():
    seen: dict = {}
    sample(seen, os.sysconf("SC_CLK_TCK"), before=True)
    mine = [v for (pid, _), v in seen.items() if pid == os.getpid()]
    assert mine[0][2] == mine[0][1]  # seen before the command: its CPU so far is the base
    with open("/proc/self/cmdline", "rb") as f:
        assert len(mine) == 1 and mine[0][0] == f.read().replace(b"\0", b" ").decode()
    first = mine[0][1]
    end = os.times().user + 0.05
    while os.times().user < end:  # spend some CPU
        pass
    sample(seen, os.sysconf("SC_CLK_TCK"))
    assert [v for (pid, _), v in seen.items() if pid == os.getpid()][0][1] >= first
    cpu, count = by_kind(
        {
            (1, "0"): ["/x/python -m pytest -q ", 2.0, 0.0, 1],  # started during the command
            (2, "0"): ["", 5.0, 0.0, None],  # a kernel thread: left out
            (3, "0"): ["/x/python -m pytest -x ", 7.0, 6.5, 3],  # running before: its delta
            (4, "0"): ["/usr/bin/daemon ", 9.0, 9.0, None],  # idle meanwhile: left out
        }
    )
    assert cpu == {"pytest": 2.5} and count == {"pytest": 2}


def test_a_child_s_cpu_goes_to_its_nearest_pytest_ancestor():
    """``--by-file``'s sampler: this test runs in a pytest process, so a child it starts is
    owned by it, and the CPU the child spends between two passes is added to this pid."""
    seen: dict = {}
    ticks = os.sysconf("SC_CLK_TCK")
    sample(seen, ticks, before=True)
    busy = "import time\nend = time.process_time() + 0.3\nwhile time.process_time() < end: pass"
    child = subprocess.Popen([sys.executable, "-c", busy + "\ntime.sleep(30)"])
    try:
        deadline = time.monotonic() + 30
        owned = 0.0
        while owned < 0.25:  # its 0.3 CPU-s, in one pass or several
            assert time.monotonic() < deadline, seen
            deltas: dict = {}
            sample(seen, ticks, deltas=deltas)
            owned += deltas.get(os.getpid(), 0.0)
            time.sleep(0.1)
        rows = [v for (pid, _), v in seen.items() if pid == child.pid]
        assert len(rows) == 1 and rows[0][3] == os.getpid()
    finally:
        child.kill()
        child.wait(10)


def test_by_file_gives_each_pass_to_the_file_its_owner_was_running(tmp_path):
    timeline = tmp_path / "timeline"
    timeline.write_text(
        "100 10.0 tests/a.py\n"  # worker 100: a.py from t=10, then b.py from t=20
        "200 12.0 tests/c.py\n"
        "100 20.0 tests/b.py\n"
    )
    samples = [
        (5.0, {100: 1.0}),  # before its first file: collection
        (11.0, {100: 2.0, None: 0.5}),  # a daemon nobody owns
        (15.0, {100: 3.0, 200: 4.0, 300: 0.25}),  # 300: a pytest process without files
        (25.0, {100: 5.0, 200: 6.0}),
    ]
    cpu, wall = by_file(samples, str(timeline))
    assert cpu == {
        "(pytest, before its first test)": 1.0,
        "tests/a.py": 5.0,
        "tests/b.py": 5.0,
        "tests/c.py": 10.0,
        NOT_UNDER_A_TEST: 0.5,
        "(pytest, outside any test file)": 0.25,
    }
    assert wall == {"tests/a.py": 10.0, "tests/b.py": 5.0, "tests/c.py": 13.0}
