"""benchmarks/suite_cpu.py: the kinds of the processes a test-suite run starts, and the
sampler over this process's own /proc entry."""

from __future__ import annotations

import os

import pytest

from benchmarks.suite_cpu import by_kind, kind_of, sample


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
            (1, "0"): ["/x/python -m pytest -q ", 2.0, 0.0],  # started during the command
            (2, "0"): ["", 5.0, 0.0],  # a kernel thread: left out
            (3, "0"): ["/x/python -m pytest -x ", 7.0, 6.5],  # running before: its delta
            (4, "0"): ["/usr/bin/daemon ", 9.0, 9.0],  # idle meanwhile: left out
        }
    )
    assert cpu == {"pytest": 2.5} and count == {"pytest": 2}
