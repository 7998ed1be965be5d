"""The test process's forkserver for engine and prefill child processes.

Each child must start clean (no NIXL/UCX agent, no threads of the test process: a plain
``fork`` of pytest would inherit both), which ``spawn`` gives at the price of importing torch,
transformers' model configuration (it pulls torch._dynamo and torch.distributed.tensor) and
the engine stack again: about 4 CPU-seconds per child, measured at ~45 children in a full run
on two cores. A forkserver imports them once per test process; its children are forks of that
server, which has imported modules but created no agent and runs no thread.

Python keeps one forkserver per process and its preload list is fixed when it starts, so every
caller asks for the same list (``context()``)."""

from __future__ import annotations

import multiprocessing as mp

PRELOAD = [
    "torch",
    "transformers.models.auto.configuration_auto",
    "transformers.models.llama.configuration_llama",
    "tandem.kvtransfer.nixl_worker",
    "tandem.scheduler.request",
    "tandem.workers.engine.core",
    "tandem.workers.engine.service",
]


def context() -> mp.context.BaseContext:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx
