"""Router: which engine gets a request.

    prefill pool: least queued prefill tokens (tokens sent, not yet answered)
    decode pool : lowest KV usage + running share (latest stats + in-flight here)
    colocated   : same rule as decode
    in flight and queued prefill tokens count every gateway's: this one's
    own, live, plus the others' as they last published them (several
    gateways: peer_load.py)
    conditional disaggregation: prompts shorter than ``disagg_min_tokens``
    skip the prefill pool and prefill on the decode engine.

The router only keeps counters; ``RayBackend`` tells it what was sent and
what came back. All calls happen on the gateway's event loop thread.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class EngineState:
    engine_id: str
    role: str
    epoch: int = 0
    ready: bool = False
    max_num_seqs: int = 1
    queued_prefill_tokens: int = 0  # this gateway's (see the module doc)
    num_inflight: int = 0
    # the other gateways' counts, as published (peer_load.py; 0 with one gateway)
    peer_queued_prefill_tokens: int = 0
    peer_inflight: int = 0
    kv_cache_usage: float = 0.0
    num_running: int = 0
    num_waiting: int = 0
    info: dict = field(default_factory=dict)

    @property
    def all_inflight(self) -> int:
        """Requests in flight on this engine from every gateway."""
        return self.num_inflight + self.peer_inflight

    @property
    def all_queued_prefill_tokens(self) -> int:
        """Queued prefill tokens on this engine from every gateway."""
        return self.queued_prefill_tokens + self.peer_queued_prefill_tokens


class Router:
    def __init__(self, disagg_min_tokens: int = 0) -> None:
        if disagg_min_tokens < 0:
            raise ValueError(f"disagg_min_tokens must be >= 0, got {disagg_min_tokens}")
        self.disagg_min_tokens = disagg_min_tokens
        self.engines: dict[str, EngineState] = {}
        self.num_decisions = {"remote": 0, "local": 0}

    def add(self, engine_id: str, role: str) -> EngineState:
        st = self.engines[engine_id] = EngineState(engine_id, role)
        return st

    def remove(self, engine_id: str) -> None:
        self.engines.pop(engine_id, None)

    def ready_engines(self, role: str) -> list[EngineState]:
        return [e for e in self.engines.values() if e.role == role and e.ready]

    def pools(self) -> set[str]:
        return {e.role for e in self.engines.values()}

    def pick_prefill(self, exclude: set[str] = frozenset()) -> EngineState | None:
        cands = [e for e in self.ready_engines("prefill") if e.engine_id not in exclude]
        if not cands:
            return None
        return min(cands, key=lambda e: (e.all_queued_prefill_tokens, e.all_inflight, e.engine_id))

    def pick_generator(self, role: str, exclude: set[str] = frozenset()) -> EngineState | None:
        """Decode or colocated engine: least loaded by KV usage and running share."""
        cands = [e for e in self.ready_engines(role) if e.engine_id not in exclude]
        if not cands:
            return None

        return min(cands, key=lambda e: (load(e), e.engine_id))


def load(e: EngineState) -> float:
    """KV usage + running share: 0 idle, about 2 when full on both."""
    share = max(e.all_inflight, e.num_running + e.num_waiting) / max(e.max_num_seqs, 1)
    return e.kv_cache_usage + share
