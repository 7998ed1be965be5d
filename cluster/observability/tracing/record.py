"""One request's timeline on the gateway's clock.

The gateway stamps what it sees itself (``time.perf_counter``): arrival,
dispatch to the backend, first token, end. Each engine that worked on the
request adds a leg: its ``RequestTimings`` (offsets on the engine's own
monotonic clock from its receipt of the request) and the moment its final
output reached the gateway. The engine's timeline is placed by anchoring its
``finished_s`` at that moment; the return trip's latency (microseconds on a
host, a network hop across hosts) is the error, and no wall clocks are
compared across machines.

    gateway   arrival ─tokenize─ dispatch ──────── first token ────────── end
    P leg              receipt ─queue─ scheduled ─compute─ first token|
    D leg                                  receipt ─(kv READ)─ scheduled ─decode─ finished|
"""

from __future__ import annotations

import contextvars
import dataclasses
import time

from tandem.wire.engine_protocol import NOT_REACHED, RequestTimings

# The caller's W3C ``traceparent`` header; the HTTP route sets it only when
# tracing is on, the gateway copies it into the request's record.
TRACEPARENT: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "tandem_traceparent", default=None
)


@dataclasses.dataclass(slots=True)
class EngineLeg:
    timings: RequestTimings
    received_s: float  # gateway perf_counter when the final output arrived

    def at(self, offset_s: float) -> float:
        """An engine offset on the gateway's clock (``NOT_REACHED`` stays)."""
        if offset_s < 0:
            return NOT_REACHED
        return self.received_s - self.timings.finished_s + offset_s

    @property
    def receipt_s(self) -> float:
        return self.at(0.0)


@dataclasses.dataclass(slots=True)
class Phases:
    """Seconds per phase; ``None`` when the phase did not happen."""

    queue_s: float | None
    prefill_s: float | None
    transfer_s: float | None
    first_token_s: float | None
    decode_s: float | None
    total_s: float

    def as_log_fields(self) -> dict[str, float | None]:
        # each field read by name, once per request (dataclasses.asdict deep-copies: 6x
        # the cost; a comprehension over the field names, a generator and a zip, 2x)
        return {
            "queue_s": _round(self.queue_s),
            "prefill_s": _round(self.prefill_s),
            "transfer_s": _round(self.transfer_s),
            "first_token_s": _round(self.first_token_s),
            "decode_s": _round(self.decode_s),
            "total_s": round(self.total_s, 6),
        }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 6)


@dataclasses.dataclass(slots=True)
class RequestRecord:
    """Written by the gateway's generation loop (event loop thread only)."""

    request_id: str
    route: str  # "completions" | "chat.completions"
    arrival_s: float  # perf_counter at HTTP arrival
    arrival_ns: int  # time.time_ns() at the same moment: maps perf_counter to wall time
    num_prompt_tokens: int
    dispatch_s: float = NOT_REACHED  # handed to the backend (tokenized, validated)
    first_token_s: float = NOT_REACHED
    end_s: float = NOT_REACHED
    path: str = "local"  # "remote": the first token came from a prefill engine
    outcome: str = "abort"
    num_output_tokens: int = 0
    legs: list[EngineLeg] = dataclasses.field(default_factory=list)
    traceparent: str | None = None  # the caller's W3C header, kept only when tracing
    # the router's decision (engines, reason, predicted/actual hit): Backend.route_log_fields
    router_fields: dict[str, object] = dataclasses.field(default_factory=dict)

    def add_timings(self, timings: RequestTimings, now_s: float) -> None:
        self.legs.append(EngineLeg(timings, now_s))

    def wall_ns(self, t_s: float) -> int:
        """A gateway perf_counter time as Unix nanoseconds."""
        return self.arrival_ns + int((t_s - self.arrival_s) * 1e9)

    @property
    def prefill_leg(self) -> EngineLeg | None:
        """The engine that computed the prompt (P, or the local engine)."""
        return self.legs[0] if self.legs else None

    @property
    def decode_leg(self) -> EngineLeg | None:
        """The decode engine of a remote request (it read its KV from P)."""
        if len(self.legs) > 1 and self.path == "remote":
            return self.legs[-1]
        return None

    def phases(self) -> Phases:
        end_s = self.end_s if self.end_s >= 0 else time.perf_counter()
        prefill, decode = self.prefill_leg, self.decode_leg
        queue_s = prefill_s = transfer_s = decode_s = None
        if prefill is not None:
            t = prefill.timings
            if t.queue_s >= 0:
                queue_s = t.queue_s
            if t.first_token_s >= 0 and t.scheduled_s >= 0:
                prefill_s = t.first_token_s - t.scheduled_s
            if decode is None and t.first_token_s >= 0:
                decode_s = t.finished_s - t.first_token_s
        if decode is not None:
            t = decode.timings
            if t.kv_load_s >= 0:
                transfer_s = t.kv_load_s
            if t.scheduled_s >= 0:
                decode_s = t.finished_s - t.scheduled_s
        first_token_s = self.first_token_s - self.arrival_s if self.first_token_s >= 0 else None
        return Phases(
            queue_s, prefill_s, transfer_s, first_token_s, decode_s, end_s - self.arrival_s
        )
