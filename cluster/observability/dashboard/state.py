"""``GET /cluster/state``: the cluster as one JSON document.

Built from what the gateway already holds (no call to an engine):
``Backend.metrics_snapshot()`` (each engine's latest ``EngineStats`` and the
gateway's view of its health), ``GatewayMetrics`` and ``RollingStats``.
The structs below are the documented schema (README, "Operators").
"""

from __future__ import annotations

import time
from typing import Any

import msgspec

from tandem.cluster.gateway.backend import (
    Backend,
    EngineMetrics,
    PeerLoadStats,
    PlannerState,
    PoolMoves,
    ScalingEvent,
)
from tandem.cluster.observability.dashboard.rolling import RollingStats, WindowStats
from tandem.cluster.observability.gateway_peers import cluster_counters
from tandem.cluster.observability.metrics import GatewayMetrics

MAX_RECENT_ERRORS = 20


class TierRow(msgspec.Struct):
    medium: str  # "host" | "disk"
    used_bytes: int
    capacity_bytes: int
    blocks: int
    hits: float  # blocks loaded back
    evictions: float


class EngineRow(msgspec.Struct):
    id: str
    role: str
    epoch: int
    state: str  # "alive", "slow", "dead" or "starting"
    ready: bool  # the router may send it requests
    running: int
    waiting: int
    waiting_for_remote_kv: int
    kv_usage: float  # 0..1
    blocks_held: int  # held for a decode engine's read (prefill)
    transfers_in_flight: int  # KV reads in flight (decode)
    restarts: int
    last_error: str
    steps: int
    last_step_s: float
    preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    # KV tiers below the device cache (kvtransfer/tiers/): one row per tier, none without
    kv_tiers: list[TierRow] = []
    # speculative decoding: accepted / drafted tokens since start (-1: no drafts yet)
    spec_acceptance: float = -1.0
    # The router's load figures (cluster/routing/router.py): requests not ended on
    # the engine and their predicted uncached prompt tokens not yet prefilled.
    # Without a suffix every gateway's (what the router scores: the same on every
    # gateway within the sharing delay); "_here" this gateway's, "_peers" the other
    # gateways' as they last published them (cluster/routing/peer_load.py).
    requests_in_flight: int = 0
    queued_prefill_tokens: int = 0
    requests_in_flight_here: int = 0
    queued_prefill_tokens_here: int = 0
    requests_in_flight_peers: int = 0
    queued_prefill_tokens_peers: int = 0


class PoolRow(msgspec.Struct):
    role: str
    engines: int
    ready: int
    running: int
    waiting: int


class ErrorRow(msgspec.Struct):
    time_s: float  # wall clock
    source: str  # engine id, "gateway", or "request <id>"
    message: str


class Counters(msgspec.Struct):
    requests_in_flight: int
    finished: dict[str, int]  # by finish reason
    rejected: dict[str, int]  # by HTTP status code
    streams_cut: int
    orphans_aborted: int
    reader_restarts: int
    engine_restarts: int


class ClusterState(msgspec.Struct):
    time_s: float
    model: str
    ready: bool
    not_ready_reason: str
    pools: list[PoolRow]
    engines: list[EngineRow]
    # the whole rolling window (``window_s``); both: every gateway's requests (rolling.py)
    window: WindowStats | None
    series: list[WindowStats]  # one point per sampling interval, oldest first
    counters: Counters  # every gateway's, summed (several gateways: gateway_peers.py)
    recent_errors: list[ErrorRow]  # newest first
    # several gateways: each one's counters ("index", "pid", "live", ...); else empty
    gateways: list[dict] = []
    # elastic pools (cluster/disagg/scaling.py): engines started / stopped, newest
    # first, and the running planner's mode and latest decisions
    scaling: list[ScalingEvent] = []
    scaling_actions: dict[str, int] = {}  # "pool/action/outcome" -> count
    planner: PlannerState | None = None
    # may an engine move between the prefill and decode pools, and why not
    pool_moves: PoolMoves | None = None
    # several gateways: this gateway's view of the others' in-flight records (its
    # index, the live peers with their record's age, its counters); None with one
    peer_load: PeerLoadStats | None = None


def cluster_state(
    backend: Backend, metrics: GatewayMetrics, rolling: RollingStats, peers: Any = None
) -> ClusterState:
    """``peers``: a ``GatewayPeers`` when several gateways serve (their
    counters summed, and listed per gateway)."""
    snapshot = backend.metrics_snapshot()
    engines = [_engine(e) for e in snapshot.engines]
    pools = []
    for role in sorted({e.role for e in engines} | set(snapshot.pool_sizes)):
        members = [e for e in engines if e.role == role]
        pools.append(
            PoolRow(
                role=role,
                engines=len(members),
                ready=sum(e.ready for e in members),
                running=sum(e.running for e in members),
                waiting=sum(e.waiting + e.waiting_for_remote_kv for e in members),
            )
        )
    errors = [ErrorRow(e.time_s, e.source, e.message) for e in snapshot.recent_errors]
    errors += [ErrorRow(t, f"request {rid}", msg) for t, rid, msg in metrics.recent_failures]
    errors.sort(key=lambda e: e.time_s, reverse=True)
    ready, reason = backend.is_ready()
    gateways: list[dict] = []
    in_flight = metrics.num_requests_in_flight
    finished, rejected = dict(metrics.num_finished), dict(metrics.num_rejected)
    if peers is not None:
        gateways = peers.gateway_rows()
        total = cluster_counters(gateways)
        in_flight, finished, rejected = (
            total["requests_in_flight"],
            total["finished"],
            total["rejected"],
        )
    return ClusterState(
        time_s=time.time(),
        model=backend.model_name,
        ready=ready,
        not_ready_reason=reason,
        pools=pools,
        engines=engines,
        window=rolling.window(),
        series=rolling.series(),
        counters=Counters(
            requests_in_flight=in_flight,
            finished=finished,
            rejected=rejected,
            streams_cut=snapshot.num_streams_cut,
            orphans_aborted=snapshot.num_orphans_aborted,
            reader_restarts=snapshot.num_reader_restarts,
            engine_restarts=snapshot.num_engine_restarts,
        ),
        recent_errors=errors[:MAX_RECENT_ERRORS],
        gateways=gateways,
        scaling=list(reversed(snapshot.scaling_events))[:MAX_RECENT_ERRORS],
        scaling_actions=dict(snapshot.scaling_actions),
        planner=snapshot.planner,
        pool_moves=snapshot.pool_moves,
        peer_load=snapshot.peer_load,
    )


def _engine(e: EngineMetrics) -> EngineRow:
    s, q = e.stats, e.stats.scheduler
    return EngineRow(
        id=s.engine_id,
        role=s.role,
        epoch=e.epoch,
        state=e.state,
        ready=e.ready,
        running=q.num_running_reqs,
        waiting=q.num_waiting_reqs,
        waiting_for_remote_kv=q.num_waiting_for_remote_kvs,
        kv_usage=q.kv_cache_usage,
        blocks_held=q.num_blocks_held_for_transfer,
        transfers_in_flight=s.num_transfers_in_flight,
        restarts=e.num_restarts,
        last_error=e.last_error,
        steps=s.num_steps,
        last_step_s=s.last_step_s,
        preemptions=q.num_preemptions,
        prefix_cache_queries=q.prefix_cache_queries,
        prefix_cache_hits=q.prefix_cache_hits,
        kv_tiers=[
            TierRow(
                t.medium, t.used_bytes, t.capacity_bytes, t.blocks, t.hits_total, t.evictions_total
            )
            for t in (s.kv_offload.tiers if s.kv_offload is not None else ())
        ],
        spec_acceptance=(
            q.spec_decode_num_accepted_tokens / q.spec_decode_num_draft_tokens
            if q.spec_decode_num_draft_tokens
            else -1.0
        ),
        requests_in_flight=e.num_inflight + e.peer_inflight,
        queued_prefill_tokens=e.queued_prefill_tokens + e.peer_queued_prefill_tokens,
        requests_in_flight_here=e.num_inflight,
        queued_prefill_tokens_here=e.queued_prefill_tokens,
        requests_in_flight_peers=e.peer_inflight,
        queued_prefill_tokens_peers=e.peer_queued_prefill_tokens,
    )
