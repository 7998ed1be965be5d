"""What an engine reports about where one request's time went.

Every time is seconds on the engine's own monotonic clock, counted from when
the engine received the request (``Request.arrival_mono``): no wall clock is
compared across processes. The gateway places the engine's timeline in its
own by anchoring ``finished_s`` at the moment the output arrived
(``cluster/observability/tracing/record.py``).

    receipt --queue--> scheduled --compute--> first token --decode--> finished
    D only:  receipt --> kv_load_start --(READ)--> kv_load_end --> first token

A time that did not happen is ``-1.0`` (``NOT_REACHED``).
"""

from __future__ import annotations

from typing import Annotated

import msgspec

NOT_REACHED = -1.0

_Seconds = Annotated[float, msgspec.Meta(ge=NOT_REACHED)]
_Count = Annotated[int, msgspec.Meta(ge=0)]


class RequestTimings(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True):
    """Sent once per request and engine, on the engine's final output for it
    (P's only output under P/D). Validated by msgspec on the gateway's socket
    (``wire/frames.py``): a negative duration or count makes the frame
    malformed."""

    engine_id: str
    epoch: int
    role: str  # "prefill" | "decode" | "colocated"
    finished_s: _Seconds  # receipt -> this final output
    scheduled_s: _Seconds = NOT_REACHED  # receipt -> first scheduled to compute
    first_token_s: _Seconds = NOT_REACHED  # receipt -> first token sampled here
    kv_load_start_s: _Seconds = NOT_REACHED  # receipt -> blocks allocated for a remote READ
    kv_load_end_s: _Seconds = NOT_REACHED  # receipt -> the READ landed (or failed)
    num_kv_blocks: _Count = 0  # blocks read from the prefill engine
    num_kv_bytes: _Count = 0
    num_kv_descriptors: _Count = 0  # NIXL descriptors of the READ
    num_preemptions: _Count = 0

    @property
    def queue_s(self) -> float:
        """Receipt to the first compute or the start of the KV load."""
        starts = [t for t in (self.scheduled_s, self.kv_load_start_s) if t >= 0]
        return min(starts) if starts else NOT_REACHED

    @property
    def kv_load_s(self) -> float:
        if self.kv_load_start_s < 0 or self.kv_load_end_s < 0:
            return NOT_REACHED
        return self.kv_load_end_s - self.kv_load_start_s
