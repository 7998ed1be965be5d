"""Per-request timestamps inside one engine, reported as ``RequestTimings``.

The engine loop calls ``received`` when a request is queued, ``after_step``
after every step and ``forget`` on an abort; nothing else touches it (loop
thread only). Per step it looks at the step's new requests, its outputs and
the requests waiting for remote KV: a few dict operations per request, no
allocation for requests that did not change.

    received ─ scheduled (first compute) ─ first token ─ final output
             └ kv_load_start (blocks allocated for a READ) ─ kv_load_end
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from tandem.scheduler.messages import SchedulerOutput
from tandem.wire.engine_protocol import NOT_REACHED, EngineOutput, RequestTimings


class _Marks:
    __slots__ = (
        "received",
        "scheduled",
        "first_token",
        "kv_start",
        "kv_end",
        "num_kv_blocks",
        "num_kv_bytes",
        "num_kv_descriptors",
        "num_preemptions",
    )

    def __init__(self, received: float) -> None:
        self.received = received
        self.scheduled = self.first_token = self.kv_start = self.kv_end = NOT_REACHED
        self.num_kv_blocks = self.num_kv_bytes = self.num_kv_descriptors = 0
        self.num_preemptions = 0


class RequestClock:
    """Marks of the requests this engine holds; one ``RequestTimings`` per
    request on its final output (``EngineOutput.timings``)."""

    def __init__(
        self,
        engine_id: str,
        epoch: int,
        role: str,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.engine_id, self.epoch, self.role = engine_id, epoch, role
        self.clock = clock
        self._open: dict[str, _Marks] = {}
        self._loading: set[str] = set()  # kv_start set, kv_end not yet

    def received(self, request_id: str) -> None:
        self._open[request_id] = _Marks(self.clock())

    def forget(self, request_ids: Iterable[str]) -> None:
        """Aborted requests: no final output will carry their timings."""
        for rid in request_ids:
            self._open.pop(rid, None)
            self._loading.discard(rid)

    def after_step(
        self,
        step_start: float,
        so: SchedulerOutput,
        outputs: list[EngineOutput],
        waiting_for_remote: Mapping[str, Any],
        load_records: Iterable[tuple[str, int, int, int, float, float]] = (),
    ) -> None:
        """``step_start``: ``clock()`` before ``schedule()``. ``load_records``:
        ``(request_id, num_blocks, num_bytes, num_descriptors, start, end)`` of
        READs that completed in this step (``NixlWorkerSide.drain_load_records``;
        start/end on ``clock``): they also bound the load when a READ posted and
        landed inside one step, so the request never showed as waiting."""
        open_ = self._open
        now = self.clock()
        for new in so.scheduled_new_reqs:
            marks = open_.get(new.req_id)
            if marks is not None and marks.scheduled < 0 and new.req_id not in self._loading:
                marks.scheduled = step_start
        for rid in so.preempted_req_ids:
            marks = open_.get(rid)
            if marks is not None:
                marks.num_preemptions += 1
        for rid in waiting_for_remote:
            marks = open_.get(rid)
            if marks is not None and marks.kv_start < 0:
                marks.kv_start = step_start
                self._loading.add(rid)
        if self._loading:
            for rid in [r for r in self._loading if r not in waiting_for_remote]:
                self._loading.discard(rid)
                marks = open_.get(rid)
                if marks is not None:
                    marks.kv_end = now
        for rid, num_blocks, num_bytes, num_descriptors, start, end in load_records:
            marks = open_.get(rid)
            if marks is not None:
                marks.num_kv_blocks += num_blocks
                marks.num_kv_bytes += num_bytes
                marks.num_kv_descriptors += num_descriptors
                if marks.kv_start < 0 or start < marks.kv_start:
                    marks.kv_start = min(start, step_start)
                if marks.kv_end < 0:
                    marks.kv_end = max(end, marks.kv_start)
                self._loading.discard(rid)
        for out in outputs:
            marks = open_.get(out.request_id)
            if marks is None:
                continue
            if out.new_token_ids and marks.first_token < 0:
                marks.first_token = now
            if out.finish_reason is not None:
                del open_[out.request_id]
                self._loading.discard(out.request_id)
                out.timings = self._timings(marks, now)

    def _timings(self, marks: _Marks, now: float) -> RequestTimings:
        t0 = marks.received

        def since(t: float) -> float:
            return NOT_REACHED if t < 0 else max(0.0, t - t0)

        return RequestTimings(
            self.engine_id,
            self.epoch,
            self.role,
            finished_s=max(0.0, now - t0),
            scheduled_s=since(marks.scheduled),
            first_token_s=since(marks.first_token),
            kv_load_start_s=since(marks.kv_start),
            kv_load_end_s=since(marks.kv_end),
            num_kv_blocks=marks.num_kv_blocks,
            num_kv_bytes=marks.num_kv_bytes,
            num_kv_descriptors=marks.num_kv_descriptors,
            num_preemptions=marks.num_preemptions,
        )

    def check_integrity(self, live_request_ids: Iterable[str]) -> None:
        """Every open mark belongs to a request the scheduler still holds."""
        orphans = set(self._open) - set(live_request_ids)
        assert not orphans, f"timings kept for requests the scheduler forgot: {sorted(orphans)}"
        assert self._loading <= set(self._open), "loading marks without a request"
