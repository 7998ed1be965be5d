"""What an engine reports about itself: ``EngineStats``, one typed struct.

The engine builds it on its loop thread (``EngineCore.stats()``); the engine
actor sends it msgpack-encoded over Ray (``EngineStats`` bytes), and the
gateway decodes it with ``decode_engine_stats`` (``wire.frames`` rules: a
payload that is not msgpack of this type raises ``MalformedFrame`` and is
counted, never trusted). The gateway's ``/metrics`` and ``/cluster/state``
read nothing else from an engine.

``Histogram`` is the one histogram implementation: engines use it for KV
transfer time, the gateway for its request-level histograms
(``cluster/observability/metrics.py``). Pure Python + msgspec (``scheduler`` imports no
torch).
"""

from __future__ import annotations

import bisect
import math

import msgspec

from tandem.wire.engine_protocol import SchedulerStats


class HistogramSnapshot(msgspec.Struct, forbid_unknown_fields=True):
    """A cumulative histogram: ``bucket_counts[i]`` counts observations
    ``<= bucket_upper_bounds[i]`` (like Prometheus); the ``+Inf`` bucket is
    ``count``."""

    bucket_upper_bounds: list[float]
    bucket_counts: list[int]
    count: int = 0
    sum: float = 0.0


class Histogram:
    """Fixed buckets, a bisect and two additions per observation. Not
    thread-safe: one thread observes (an engine's loop, the gateway's event
    loop) and the same thread reads (prometheus_client's own histogram takes
    a lock per observation, ~5x the cost, which shows at one observation per
    streamed token)."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        if list(bounds) != sorted(set(bounds)):
            raise ValueError(f"histogram bounds must increase strictly: {bounds}")
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # last: above every bound
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def snapshot(self) -> HistogramSnapshot:
        cumulative, counts = 0, []
        for count in self.counts[:-1]:
            cumulative += count
            counts.append(cumulative)
        return HistogramSnapshot(list(self.bounds), counts, cumulative + self.counts[-1], self.sum)


def prometheus_buckets(snapshot: HistogramSnapshot) -> list[tuple[str, int]]:
    """``[(le, cumulative count), ..., ("+Inf", count)]`` for prometheus_client."""
    buckets = [
        (repr(float(bound)), count)
        for bound, count in zip(snapshot.bucket_upper_bounds, snapshot.bucket_counts, strict=True)
    ]
    buckets.append(("+Inf", snapshot.count))
    return buckets


def quantile(snapshot: HistogramSnapshot, q: float) -> float | None:
    """The ``q`` quantile (0..1) interpolated inside its bucket, as
    Prometheus' ``histogram_quantile`` does; None without observations. A
    quantile in the ``+Inf`` bucket is the largest finite bound."""
    if snapshot.count <= 0:
        return None
    rank = q * snapshot.count
    lower_bound, lower_count = 0.0, 0
    for bound, count in zip(snapshot.bucket_upper_bounds, snapshot.bucket_counts, strict=True):
        if count >= rank and count > lower_count:
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (
                count - lower_count
            )
        lower_bound, lower_count = bound, count
    return snapshot.bucket_upper_bounds[-1] if snapshot.bucket_upper_bounds else math.nan


class KVTransferStats(msgspec.Struct, forbid_unknown_fields=True):
    """The KV connector's side of an engine (P: sends, D: reads). Counters
    are cumulative since the engine started."""

    transfer_bytes_total: float = 0.0
    transfer_descriptors_total: float = 0.0
    transfer_failures_total: float = 0.0
    notification_failures_total: float = 0.0
    lease_expiries_total: float = 0.0
    quarantined_loads_total: float = 0.0
    loads_in_flight: int = 0  # D: reads posted and not finished
    loads_in_quarantine: int = 0  # D: reads NIXL could not cancel
    sends_blocks_held: int = 0  # P: blocks the worker tracks until D is done
    transfer_seconds: HistogramSnapshot | None = None  # D: one request's read
    # what UCX picked for READs into this engine's KV (kvtransfer/ucx/probe.py);
    # "" until the start-up probe has run (or with the probe off)
    transport: str = ""  # e.g. "cuda_ipc/cuda", "cma/memory", "tcp/lo"
    transport_path: str = ""  # "zero-copy", "software emulation", ...
    transport_memory: str = ""  # "DRAM" | "VRAM"
    transport_slow: bool = False  # VRAM READs over TCP or emulated: the slow fallback


class WireStats(msgspec.Struct, forbid_unknown_fields=True):
    """Per internal-plane socket of the engine: dropped malformed messages
    and handshakes refused by CURVE/ZAP."""

    malformed_frames: dict[str, int] = {}
    auth_failures: dict[str, int] = {}


class StructuredOutputStats(msgspec.Struct, forbid_unknown_fields=True):
    """Structured outputs of one engine (``workers/structured/manager.py``); counters
    are cumulative since the engine started."""

    backend: str = ""
    constrained_requests_total: int = 0  # requests that carried a constraint
    cache_hits_total: int = 0  # compiles answered by the grammar cache (or one in flight)
    cache_misses_total: int = 0
    compile_failures_total: int = 0  # invalid for this tokenizer, or past the deadline
    compile_seconds: HistogramSnapshot | None = None  # one grammar's compile
    mask_seconds: HistogramSnapshot | None = None  # one step's bitmask fill (all its rows)


class KVOffloadTierStats(msgspec.Struct, forbid_unknown_fields=True):
    """One KV tier below the device cache (``kvtransfer/tiers/``)."""

    medium: str  # "host" | "disk"
    used_bytes: int = 0
    capacity_bytes: int = 0
    blocks: int = 0
    stored_bytes_total: float = 0.0
    loaded_bytes_total: float = 0.0
    hits_total: float = 0.0  # blocks loaded back from this tier
    evictions_total: float = 0.0


class KVOffloadStats(msgspec.Struct, forbid_unknown_fields=True):
    """An engine's KV tiers: per tier, and what the tier thread did."""

    tiers: list[KVOffloadTierStats] = []
    store_queue_depth: int = 0
    loads_in_flight: int = 0
    failures_total: dict[str, float] = {}  # by reason: load, timeout, dropped, disk_full, ...
    load_seconds: HistogramSnapshot | None = None  # one request's load from the tiers


class EngineStats(msgspec.Struct, forbid_unknown_fields=True):
    """One engine at one moment (its loop thread, between steps).

    ``scheduler`` holds running / waiting / waiting-for-remote-KV, KV usage,
    blocks held for transfer, prefix-cache queries and hits, preemptions and
    token counts. ``num_transfers_in_flight`` is KV reads in flight (decode
    engines; a prefill engine's pending sends show as blocks held).
    ``last_step_s``: wall time of the engine's latest ``step()``;
    ``last_step_num_tokens``: the tokens it computed (the planner compares the
    two with its profile).
    """

    engine_id: str
    role: str  # "prefill", "decode" or "colocated"
    epoch: int
    num_steps: int = 0
    last_step_s: float = 0.0
    scheduler: SchedulerStats = msgspec.field(default_factory=SchedulerStats)
    num_transfers_in_flight: int = 0
    kv_transfer: KVTransferStats | None = None  # engines with a KV connector
    wire: WireStats = msgspec.field(default_factory=WireStats)
    output_backlog_messages: int = 0
    output_deferred_total: int = 0
    num_streams_cut: int = 0  # cut by the engine's output stall timeout
    num_gateways: int = 0  # gateways joined (workers/engine/gateway_outputs.py)
    num_gateways_lost: int = 0  # dropped because their connection stayed down
    num_gateway_requests_aborted: int = 0  # requests of dropped gateways
    structured: StructuredOutputStats | None = None  # workers/structured/manager.py
    kv_offload: KVOffloadStats | None = None  # engines with KV tiers
    last_step_num_tokens: int = 0


# Decodes (and validates) an engine's stats payload; callers go through
# ``wire.frames.decode`` so a bad one is a counted ``MalformedFrame``.
STATS_DECODER = msgspec.msgpack.Decoder(EngineStats)
