"""The overlapped engine loop (``--async-scheduling``): step N+1 is scheduled and
launched while step N runs.

    loop thread   schedule N+1 | plan N+1 | launch | read N's tokens | update N | schedule N+2 ...
    step stream   ... forward+sample N ....| forward+sample N+1 (ids of N scattered in) ...

The step stream runs each step's device work in launch order: on CPU on a thread of its
own (torch releases the GIL inside its kernels, so the loop thread's scheduling and
planning overlap the forward), on CUDA inline (kernel launches return before the kernels
run, so the device works on step N while the loop thread schedules N+1), and inline for
the synchronous loop. Both loops run the same ``ModelRunner.launch`` /
``finish`` code: the synchronous one finishes each step right after launching it.

At most one step is in flight between loop turns. A step's sampled tokens stay on the
device; the next step copies the ones it needs into its input ids there, and the loop
thread reads them (the step's one device->host sync) only after launching the next step.
Where the next step needs them on the host first, its launch reads them before planning
(``ModelRunner.launch``): batches holding a penalty / logit bias / bad words request, and
steps that start remote KV loads (a load must not land in a block the running step still
writes). Everything else (chunked prefill, prefix hits, forks, preemption, aborts)
runs overlapped, logprobs too (copied with the sampled ids); prompt logprobs too on CPU,
while on CUDA they read the device inside their own step (docs/architecture.md,
"Overlapped loop"). ``scheduler/async_scheduler.py`` says which tokens the loop drops.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from tandem.scheduler.async_scheduler import AsyncScheduler
from tandem.scheduler.messages import SchedulerOutput
from tandem.scheduler.structured_grammar import take_deferred_bitmask
from tandem.wire.engine_protocol import EngineOutputs
from tandem.workers.runner.step_batch import StepPlan
from tandem.workers.sampling.sample_logprobs import DeviceLogprobs
from tandem.workers.sampling.spec_verify import SpecResult


class StepResult:
    """A step's device outputs: sampled ids ``[num_sampled]`` (None when nothing was
    sampled) and, when some row wants logprobs, their logprobs computed on the device
    (``workers/sampling/sample_logprobs.py``).

    On CUDA the ids, and the packed logprobs with them, are copied to pinned host memory
    right after sampling, then ONE event is recorded: reading them waits for this step
    only, not for the step queued behind it (a plain ``tolist`` would queue its copy after
    the next step's kernels), and the logprobs cost no second wait."""

    __slots__ = ("sampled", "logprobs", "spec", "_host", "_ready")

    def __init__(
        self,
        sampled: torch.Tensor | None = None,
        logprobs: DeviceLogprobs | None = None,
        spec: SpecResult | None = None,
    ) -> None:
        self.sampled = sampled
        self.logprobs = logprobs
        self.spec = spec  # verified drafts, on the host (workers/runner/spec_step.py)
        self._host: torch.Tensor | None = None
        self._ready: Any = None  # torch.cuda.Event
        if sampled is not None and sampled.is_cuda:
            self._host = torch.empty(sampled.shape, dtype=sampled.dtype, pin_memory=True)
            self._host.copy_(sampled, non_blocking=True)
            if logprobs is not None:
                logprobs.copy_to_host()
            self._ready = torch.cuda.Event()
            self._ready.record()

    def token_list(self) -> list[int]:
        """The sampled ids on the host (waits for them, and for the logprobs' copy: the
        step's device->host sync)."""
        if self.sampled is None:
            return []
        if self._ready is None:
            return self.sampled.tolist()
        self._ready.synchronize()
        return self._host.tolist()


class StepHandle:
    """A launched step. ``tokens`` is set once the loop thread has read them."""

    __slots__ = ("plan", "future", "tokens", "sample_states")

    def __init__(self, plan: StepPlan) -> None:
        self.plan = plan
        self.future: Future[StepResult] | None = None
        self.tokens: list[int] | None = None
        # per sampled row: (the request's runner state, index of its PLACEHOLDER)
        self.sample_states: list[tuple[Any, int]] = []


class StepStream:
    """Runs submitted step functions one at a time, in submission order: on one worker
    thread (``threaded``), else inline in ``submit``. Either way the result is a Future
    holding the value or the exception.

    The overlapped loop threads it on CPU only: there the forward itself is the work to
    overlap, and torch releases the GIL inside its kernels. On CUDA the device already
    runs behind the host (kernel launches return at once), so the step runs inline and
    the loop thread never competes with a second Python thread for the GIL."""

    def __init__(self, threaded: bool) -> None:
        self._pool: ThreadPoolExecutor | None = None
        if threaded:
            num_threads = torch.get_num_threads()  # torch's intra-op setting is per thread
            self._pool = ThreadPoolExecutor(
                1, "tandem-step", initializer=torch.set_num_threads, initargs=(num_threads,)
            )

    @property
    def threaded(self) -> bool:
        return self._pool is not None

    def submit(self, fn: Callable[..., StepResult], *args: Any) -> Future:
        if self._pool is not None:
            return self._pool.submit(fn, *args)
        fut: Future = Future()
        try:
            fut.set_result(fn(*args))
        except BaseException as exc:  # noqa: BLE001 - re-raised by fut.result()
            fut.set_exception(exc)
        return fut

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


class OverlappedLoop:
    """``EngineCore.step`` for ``async_scheduling``: one turn schedules and launches a
    step, then finishes and applies the step launched on the previous turn. A step with
    no tokens (only transfers to poll, finished ids to pass on) is applied at once."""

    def __init__(self, scheduler: AsyncScheduler, runner: Any) -> None:
        self.scheduler = scheduler
        self.runner = runner  # workers.runner.model_runner.ModelRunner with an overlapping stream
        self.in_flight: tuple[SchedulerOutput, StepHandle] | None = None

    def step(self) -> tuple[SchedulerOutput, EngineOutputs]:
        """One turn: (the step just scheduled, the outputs applied this turn)."""
        sched, runner = self.scheduler, self.runner
        so = sched.schedule()
        prev = self.in_flight
        self.in_flight = None
        outputs = []
        if sched.grammar_deferred:
            # a constrained row's mask needs the token in flight: apply that step first
            # (scheduler/structured_grammar.py); this step runs without the overlap
            if prev is not None:
                outputs += sched.update_from_output(prev[0], runner.finish(prev[1])).outputs
                prev = None
            so.grammar_bitmask = take_deferred_bitmask(sched)
        handle = runner.launch(so, prev[1] if prev is not None else None)
        if prev is not None:
            outputs += sched.update_from_output(prev[0], runner.finish(prev[1])).outputs
        if so.total_num_scheduled_tokens == 0:
            outputs += sched.update_from_output(so, runner.finish(handle)).outputs
        else:
            self.in_flight = (so, handle)
        return so, EngineOutputs(engine_id=sched.engine_id, outputs=outputs, timestamp=time.time())
