"""The collectives of one tensor-parallel engine: a standalone process group.

    store = TCPStore on rank 0 (port picked by the OS), every rank connects
    group = ProcessGroupGloo (CPU) | ProcessGroupNCCL (CUDA) over that store

The group is an object, never torch's global default group, so one process
can hold several TP engines over its life (tests, a restarted engine) and no
``init_process_group`` state leaks between them.

Failure: gloo raises ``RuntimeError`` ("Connection closed by peer") in every
collective a dead peer should join, so a worker that dies mid-step fails the
step at once. A peer that is alive but never arrives (stopped, wedged) makes a
step collective raise after ``step_timeout_s`` (``tp_step_timeout_s``: each
op carries that timeout), while the start-up ones (``min_int``) and the
connection use the group's longer ``timeout_s``. NCCL does not notice a dead
peer by itself; its collectives give up after their timeout (and the engine
core's liveness poll sees an exit first).
"""

from __future__ import annotations

import datetime
import time

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions  # torch.distributed's own import


def backend_for(device: str | torch.device) -> str:
    """``"nccl"`` for CUDA devices, ``"gloo"`` otherwise: a device change only."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def make_store(rank: int, world_size: int, host: str, port: int, timeout_s: float) -> dist.Store:
    """Rank 0 serves the rendezvous store (``port`` 0: the OS picks; read ``.port``)."""
    return dist.TCPStore(
        host,
        port,
        world_size,
        is_master=rank == 0,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


class TPGroup:
    """``rank`` of ``size`` ranks; the collectives the sharded layers call.

    With ``size == 1`` (or no process group) every collective is the identity.
    ``step_timeout_s``: how long ``all_reduce`` / ``all_gather_last_dim`` wait
    for the other ranks before raising ``RuntimeError`` (None: the group's).
    """

    def __init__(
        self,
        rank: int,
        size: int,
        pg: dist.ProcessGroup | None = None,
        backend: str = "gloo",
        step_timeout_s: float | None = None,
    ) -> None:
        self.rank = rank
        self.size = size
        self.pg = pg
        self.backend = backend
        self._reduce_opts = dist.AllreduceOptions()
        self._gather_opts = AllgatherOptions()
        if step_timeout_s is not None:
            timeout = datetime.timedelta(seconds=step_timeout_s)
            self._reduce_opts.timeout = timeout
            self._gather_opts.timeout = timeout
        # collectives this rank joined and the seconds it spent in them
        # (waiting for the slowest rank included): benchmarks/tensor_parallel.py
        self.num_all_reduce = 0
        self.num_all_gather = 0
        self.all_reduce_s = 0.0
        self.all_gather_s = 0.0

    @classmethod
    def connect(
        cls,
        store: dist.Store,
        rank: int,
        size: int,
        device: str | torch.device,
        timeout_s: float,
        step_timeout_s: float | None = None,
    ) -> TPGroup:
        """Join the group (blocks until every rank joined, at most ``timeout_s``)."""
        timeout = datetime.timedelta(seconds=timeout_s)
        backend = backend_for(device)
        if backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            pg = dist.ProcessGroupNCCL(store, rank, size, options)
        else:
            pg = dist.ProcessGroupGloo(store, rank, size, timeout)
        return cls(rank, size, pg, backend, step_timeout_s)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place; returns ``tensor``."""
        if self.pg is not None and self.size > 1:
            start_s = time.perf_counter()
            self.pg.allreduce([tensor], self._reduce_opts).wait()
            self.all_reduce_s += time.perf_counter() - start_s
            self.num_all_reduce += 1
        return tensor

    def all_gather_last_dim(self, tensor: torch.Tensor) -> torch.Tensor:
        """``[..., n]`` on each rank -> ``[..., size * n]``, rank order."""
        if self.pg is None or self.size == 1:
            return tensor
        start_s = time.perf_counter()
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        self.pg.allgather([parts], [tensor], self._gather_opts).wait()
        out = torch.cat(parts, dim=-1)
        self.all_gather_s += time.perf_counter() - start_s
        self.num_all_gather += 1
        return out

    def min_int(self, value: int) -> int:
        """The smallest ``value`` any rank passed (every rank must call it)."""
        if self.pg is None or self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        if self.backend == "nccl":
            t = t.cuda()
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        self.pg.allreduce([t], opts).wait()
        return int(t.item())
