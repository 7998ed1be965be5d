"""Starting and stopping the ranks of a tensor-parallel engine as processes.

``pick_launcher`` hands ``TPExecutor`` a ``start(spec)`` whose handles answer
``pid``, ``exitcode``, ``join``, ``terminate`` and ``kill``: local processes
(``ProcessLauncher``) or Ray worker actors (``workers/parallel/ray_workers.py``).
``stop_workers`` ends them whatever state they are in.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
import torch

from tandem.workers.config import EngineConfig
from tandem.workers.parallel.messages import CMD_STOP, WorkerCommand, WorkerSpec


def stop_workers(commands: list[Any], procs: list[Any], timeout_s: float) -> None:
    """A stop command to every worker, then terminate, then kill whoever is left."""
    import zmq

    stop = msgspec.msgpack.encode(WorkerCommand(CMD_STOP))
    for sock in commands:
        try:
            sock.send(stop, flags=zmq.NOBLOCK)
        except zmq.ZMQError:  # the worker is gone or not connected
            pass
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.exitcode is None:
            proc.terminate()
            proc.join(2.0)
        if proc.exitcode is None:
            proc.kill()
            proc.join(2.0)


def first_exit(procs: list[Any]) -> str | None:
    """The first worker (rank 1..) that exited, as a reason; None while all run."""
    for rank, proc in enumerate(procs, start=1):
        if proc.exitcode is not None:
            return f"rank {rank} (pid {proc.pid}) exited with code {proc.exitcode}"
    return None


def kill_all(procs: list[Any]) -> None:
    """Kill every worker still running (an engine dropped without shutdown)."""
    for proc in procs:
        if proc.exitcode is None:
            proc.kill()


class ProcessLauncher:
    """Ranks as local processes, children of the engine core process."""

    def __init__(self) -> None:
        self._ctx = worker_context()

    def start(self, spec: WorkerSpec) -> Any:
        from tandem.workers.parallel.worker import run_worker

        proc = self._ctx.Process(target=run_worker, args=(spec,), name=f"tp-rank-{spec.rank}")
        proc.daemon = True
        proc.start()
        return proc


def pick_launcher(config: EngineConfig, tp_size: int) -> Any:
    """Ray worker actors inside a Ray engine actor, else local processes."""
    from tandem.workers.parallel.ray_workers import ray_launcher

    return ray_launcher(config, tp_size) or ProcessLauncher()


def worker_context() -> Any:
    """Workers start from a forkserver that imported torch and the worker code
    once per engine-core process: each start skips those seconds of imports
    (a fork of the server, which runs no threads, unlike this process)."""
    ctx = torch.multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(
        ["torch", "tandem.workers.parallel.worker", "tandem.workers.runner.model_runner"]
    )
    return ctx
