"""KV tiers under tensor parallelism: every rank keeps its own KV shard's blocks.

Rank 0 (the engine core) keeps the one index that matters: its scheduler side
matches, pins and plans stores and loads against rank 0's tiers, exactly as at
TP=1. Each step's ``TierMeta`` rides the step's scheduler output to every
other rank (workers/parallel/), whose ``TierRankSide`` repeats the plan on its
own tiers, holding its own heads of the same blocks under the same keys::

    rank 0 (TierSchedulerSide + TierWorkerSide)    rank r > 0 (TierRankSide)
    stored / evicted blocks -> stores / cancels    register the stores, apply the cancels
    a match -> LoadJob (keys pinned)               pin the keys, load behind earlier stores
    reset_prefix_cache, aborted loads, drops  ->   the same on rank r's tiers
    finished loads (rank 0's)                      finished loads (rank r's)
                 \\___ ConnectorOutputMerger: a load is done when EVERY rank is ___/

A load whose block is missing, corrupt or late on any rank reports that block
(and the rest of its run) bad; the merged output hands the union to the
scheduler, which recomputes from the first bad block on every rank: never a
mix of loaded and recomputed heads. The failed block is then forgotten on every
rank (``TierMeta.drops``) so its recomputation stores it again everywhere.
Rank r's tiers can hold a key rank 0 does not (harmless: LRU evicts it) or lack
one (a store dropped on a full queue, or cancelled on rank r because its block was
reused before rank r's copy while rank 0's had committed): that load recomputes.
"""

from __future__ import annotations

import time
from typing import Any

from tandem.kvtransfer.tiers.config import TierConfig
from tandem.kvtransfer.tiers.connector import TierMeta, TierWorkerSide
from tandem.kvtransfer.tiers.store import LoadJob, TierStore, forget


class TierRankSide(TierWorkerSide):
    """The tiers of one tensor-parallel rank > 0 (its worker process)."""

    metadata_type = TierMeta  # the worker converts the plan back to it

    def __init__(self, store: TierStore) -> None:
        super().__init__(store)
        self.loading: dict[str, LoadJob] = {}  # this rank's loads, by request

    def start_load_kv(self, metadata: TierMeta) -> None:
        store = self.store
        if metadata.reset:
            store.reset()
        for key in metadata.cancels:  # before this step overwrites their blocks
            store.cancel(key)
        for rid in metadata.aborted:
            job = self.loading.get(rid)
            if job is not None:
                job.cancelled = True
        if metadata.drops:
            forget(store, metadata.drops)
        if metadata.loads and store.config.corrupt_host_on_rank == store.config.tp_rank:
            self._corrupt_host()
        now = time.monotonic()
        for job in metadata.loads:  # rank 0's deadline is on rank 0's clock
            job.deadline = now + store.config.load_timeout_s
            store.pin(job.keys)
            self.loading[job.req_id] = job
        for job in metadata.evict_stores:
            store.register(job)
        metadata.stores = [job for job in metadata.stores if store.register(job)]
        super().start_load_kv(metadata)

    def _corrupt_host(self) -> None:
        """The ``corrupt_host_on_rank`` test hook, once."""
        store = self.store
        if store.host is not None and not store.counters["test_corrupted"]:
            with store.lock:
                store.host.data.bitwise_not_()
                store.counters["test_corrupted"] += 1

    def get_finished(self) -> tuple[set[str], set[str]]:
        sending, done = super().get_finished()
        for rid in done:
            self.loading.pop(rid, None)
        return sending, done

    def check_integrity(self, idle: bool = True) -> None:
        """This rank's tiers (the engine's ``check_integrity`` asks every rank): when
        idle, after its queued stores are done, nothing pinned, loading or leaked."""
        if idle:
            assert self.store.flush(20), "tier stores did not drain"
            assert not self.loading, f"tier loads still tracked: {sorted(self.loading)}"
        self.store.check_integrity(idle)

    def stats(self) -> dict[str, Any]:
        return self.store.stats()


def create_rank_tiers(config: TierConfig) -> TierRankSide:
    """Rank ``config.tp_rank``'s tiers (their scheduler side is rank 0's)."""
    assert config.tp_rank > 0, "rank 0's tiers are the engine's (create_tier_connector)"
    return TierRankSide(TierStore(config))
