"""What the tiers tell operators: the engine's ``KVOffloadStats`` (the
``tandem:kv_offload_*`` families, /cluster/state, the dashboard) and the flat
counters of ``stats()`` (tests, benchmarks)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tandem.scheduler.engine_stats import KVOffloadStats, KVOffloadTierStats

if TYPE_CHECKING:
    from tandem.kvtransfer.tiers.store import TierStore

FAILURES = {  # counter -> reason label of tandem:kv_offload_failures_total
    "load_failures": "load",
    "load_timeouts": "timeout",
    "store_dropped": "store_dropped",
    "store_cancelled": "store_cancelled",
    "disk_full": "disk_full",
    "disk_store_failures": "disk_write",
    "disk_unusable": "disk_unusable",
    "failures": "internal",
}


def offload_stats(store: TierStore, loads_in_flight: int) -> KVOffloadStats:
    c = store.counters
    with store.lock:
        snapshot = store.load_seconds.snapshot()
    tiers = [
        KVOffloadTierStats(
            medium=t.medium,
            used_bytes=t.used_bytes,
            capacity_bytes=t.capacity_bytes,
            blocks=len(t.index),
            stored_bytes_total=c.get(f"{t.medium}_stored_bytes", 0.0),
            loaded_bytes_total=c.get(f"{t.medium}_loaded_bytes", 0.0),
            hits_total=c.get(f"{t.medium}_hits", 0.0),
            evictions_total=float(t.num_evictions),
        )
        for t in store.tiers()
    ]
    return KVOffloadStats(
        tiers=tiers,
        store_queue_depth=store.queue_depth(),
        loads_in_flight=loads_in_flight,
        failures_total={r: c.get(k, 0.0) for k, r in FAILURES.items()},
        load_seconds=snapshot,
    )


def flat_stats(store: TierStore) -> dict[str, float]:
    out = dict(store.counters)
    out["store_queue_depth"] = store.queue_depth()
    for tier in store.tiers():
        out[f"{tier.medium}_used_bytes"] = tier.used_bytes
        out[f"{tier.medium}_capacity_bytes"] = tier.capacity_bytes
        out[f"{tier.medium}_blocks"] = len(tier.index)
        out[f"{tier.medium}_evictions"] = tier.num_evictions
    return out
