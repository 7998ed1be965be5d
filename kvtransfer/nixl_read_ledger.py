"""The decode side's account of loads: which parts of a request's load are over, which
requests are received (with their blocks in error when a part failed), and the byte
and time figures of completed READs.

``KVReads`` plans, posts, polls and quarantines the READs; each part that can no
longer land ends here exactly once (``part_over``). A request is received when its
last part is over: ``done_recving`` (and ``error_block_ids`` if any part failed) are
taken by the engine after the step.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Any

from tandem.kvtransfer.nixl_meta import LoadSpec

_MAX_RECENT_TRANSFERS = 4096


@dataclasses.dataclass
class _Pending:
    """A request's load on this rank until its last part is over."""

    num_parts_left: int
    failed: bool = False
    num_bytes: int = 0
    num_descriptors: int = 0
    start_s: float = float("inf")
    end_s: float = 0.0


class ReadLedger:
    def __init__(self, counters: dict[str, Any]) -> None:
        self._counters = counters
        self.pending: dict[str, _Pending] = {}  # request id -> its parts not over yet
        self.done_recving: set[str] = set()
        self.error_block_ids: set[int] = set()
        # (request id, blocks, bytes, descriptors, READ posted, READ done; perf_counter) of
        # completed READs, for the engine's per-request timings
        self.load_records: collections.deque[tuple[str, int, int, int, float, float]] = (
            collections.deque(maxlen=_MAX_RECENT_TRANSFERS)
        )
        self.recent_transfer_s: collections.deque[float] = collections.deque(
            maxlen=_MAX_RECENT_TRANSFERS
        )

    def plan(self, request_id: str, num_parts: int) -> None:
        self.pending[request_id] = _Pending(num_parts)

    def take_done(self) -> set[str]:
        done, self.done_recving = self.done_recving, set()
        return done

    def take_error_blocks(self) -> set[int]:
        block_ids, self.error_block_ids = self.error_block_ids, set()
        return block_ids

    def part_over(
        self, spec: LoadSpec, failed: bool, num_bytes: int, num_descriptors: int, start_s: float
    ) -> bool:
        """One part of ``spec``'s load is over; True when it was the last (the request
        is received, its blocks in error if any part failed)."""
        pending = self.pending.get(spec.request_id)
        if pending is None:  # failed before it was planned: one part
            pending = _Pending(1)
        pending.num_parts_left -= 1
        pending.failed |= failed
        if not failed:
            pending.num_bytes += num_bytes
            pending.num_descriptors += num_descriptors
            pending.start_s = min(pending.start_s, start_s)
            pending.end_s = max(pending.end_s, time.perf_counter())
        if pending.num_parts_left > 0:
            return False
        self.pending.pop(spec.request_id, None)
        self.done_recving.add(spec.request_id)
        if pending.failed:
            self._counters["num_failures"] += 1
            self.error_block_ids.update(spec.local_block_ids)
            return True
        seconds = pending.end_s - pending.start_s
        self._counters["kv_transfer_bytes_total"] += pending.num_bytes
        self._counters["kv_transfer_seconds_total"] += seconds
        self._counters["num_transfers"] += 1
        self._counters["num_descriptors"] += pending.num_descriptors
        self._counters["last_transfer_s"] = seconds
        self.recent_transfer_s.append(seconds)
        self.load_records.append(
            (
                spec.request_id,
                len(spec.local_block_ids),
                pending.num_bytes,
                pending.num_descriptors,
                pending.start_s,
                pending.end_s,
            )
        )
        return True
