"""The scheduler of the overlapped loop: step N+1 is scheduled while step N runs.

    loop turn k:  schedule(N+1)   launch(N+1)   finish(N)   update_from_output(N)
                  ^ placeholders for N's tokens  ^ the one device->host read

At most one step is in flight between turns. Every request that samples in a step gets
one output placeholder (``scheduler/placeholders.py``) until that step's output is
applied, so the next schedule already gives it its next token and KV slot.

A request's in-flight token is dropped, never emitted, when by the time its step's
output is applied the request

- finished (EOS, a stop token or an abort arrived after it was scheduled): its blocks
  were freed when it finished; the dropped token was computed into blocks nobody reads;
- was preempted (``num_preemptions`` changed): it recomputes from its known tokens and
  samples that position again, with the same random number (``workers/sampling/sampler.py``);
- is gone, or its id now names another request.

Fork parents (``scheduler/fork.py``) are forked only once their prefill step is no longer
in flight, so the children's block copies and a prefill engine's handoff read KV that
exists.
"""

from __future__ import annotations

from collections import deque

from tandem.scheduler.messages import ModelRunnerOutput, SchedulerOutput
from tandem.scheduler.placeholders import samples_this_step
from tandem.scheduler.request import Request
from tandem.scheduler.scheduler import Scheduler
from tandem.wire.engine_protocol import EngineOutputs


class _StepRecord:
    """What one scheduled step is expected to return: sampling requests as scheduled."""

    __slots__ = ("req_ids", "sampling")

    def __init__(self, req_ids: set[str], sampling: dict[str, tuple[Request, int]]) -> None:
        self.req_ids = req_ids  # every request the step computes
        self.sampling = sampling  # id -> (request, its num_preemptions when scheduled)


class AsyncScheduler(Scheduler):
    """``Scheduler`` whose ``schedule`` may run before the previous step's
    ``update_from_output``. Outputs must be applied in the order steps were scheduled
    (``workers/runner/async_step.py`` does); with each output applied before the next schedule
    it behaves exactly like ``Scheduler``."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._steps: deque[_StepRecord] = deque()  # scheduled, output not applied yet

    @property
    def num_steps_in_flight(self) -> int:
        return len(self._steps)

    def schedule(self) -> SchedulerOutput:
        so = super().schedule()
        sampling: dict[str, tuple[Request, int]] = {}
        requests = self.requests
        for rid in so.num_scheduled_tokens:
            req = requests[rid]
            if samples_this_step(req):
                req.num_output_placeholders += 1
                sampling[rid] = (req, req.num_preemptions)
        self._steps.append(_StepRecord(set(so.num_scheduled_tokens), sampling))
        return so

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> EngineOutputs:
        record = self._steps.popleft()
        sampled = runner_output.sampled_token_ids
        for idx, rid in enumerate(runner_output.req_ids):
            if not sampled[idx]:
                continue
            expected = record.sampling.get(rid)
            req = self.requests.get(rid)
            if expected is None or req is not expected[0] or req.num_preemptions != expected[1]:
                sampled[idx] = []  # see the module docstring: dropped
                continue
            req.num_output_placeholders -= 1
        return super().update_from_output(scheduler_output, runner_output)

    def has_work(self) -> bool:
        return bool(self._steps) or super().has_work()

    def _computing(self, req: Request) -> bool:
        return any(req.request_id in step.req_ids for step in self._steps)

    def check_integrity(self, idle: bool = True) -> None:
        """``Scheduler.check_integrity`` plus: each running request's placeholders are
        the in-flight steps it samples in. Idle, a step may still be in flight (the
        loop applies it next turn): it then holds only requests already gone, whose
        tokens it drops."""
        super().check_integrity(idle)
        for req in self.running:
            num_pending = sum(
                1
                for step in self._steps
                if step.sampling.get(req.request_id, (None, -1)) == (req, req.num_preemptions)
            )
            assert req.num_output_placeholders == num_pending, (
                f"{req.request_id}: {req.num_output_placeholders} placeholders, "
                f"{num_pending} in-flight steps sample it"
            )
        for req in self.requests.values():
            assert req.num_output_placeholders >= 0, req
