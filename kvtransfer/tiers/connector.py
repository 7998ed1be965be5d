"""The tiers as the engine's KV connector: lookups and loads ride the remote-KV path.

    schedule()  device prefix hit h blocks; get_num_new_matched_tokens: the next n
                blocks' hashes in host/disk -> (n * block_size, async)
                update_state_after_alloc: pin the n keys, a LoadJob into the meta
                the request waits in WAITING_FOR_REMOTE_KVS, other requests run
    runner      start_load_kv(meta): loads to the tier thread; this step's stores wait
                get_finished() (after the step ran): its stores to the tier thread;
                finished loads -> finished_recving, their bad blocks -> load errors
    scheduler   finished_recving: publish the loaded blocks, RUNNING; bad blocks
                are recomputed from the first one (policy recompute, always)

Stores are fed by the block pool's events: every block the prefix cache
publishes (``stored``) becomes a store job once the step that computes it has
run; a block the pool evicts (``removed``) cancels a store still pending for it.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec

from tandem.kvtransfer.base import KVConnectorSchedulerSide, KVConnectorWorkerSide
from tandem.kvtransfer.compat import STORAGE_ORDER
from tandem.kvtransfer.tiers.config import TierConfig
from tandem.kvtransfer.tiers.store import LoadJob, StoreJob, TierStore, forget


class TierMeta(msgspec.Struct):
    """One step's tier work (the runner reads ``loads`` to order loads after the
    step in flight). Under tensor parallelism every rank gets the same plan
    (kvtransfer/tiers/ranks.py); the last four fields are for ranks > 0 only."""

    loads: list[LoadJob] = []
    stores: list[StoreJob] = []  # blocks this step computes
    evict_stores: list[StoreJob] = []  # store_policy "eviction", before the step
    cancels: list[bytes] = []  # keys whose device block is reused: a pending store is void
    aborted: list[str] = []  # requests whose load rank 0 cancelled (aborted)
    drops: list[bytes] = []  # keys to forget: a load of them failed on some rank
    reset: bool = False  # reset_prefix_cache: forget every unpinned block


class TierPoolEvents:
    """Stands in the block pool's ``events`` slot, passing every call on to the KV
    events recorder it wraps (None when routing has none)."""

    def __init__(self, side: TierSchedulerSide, pool: Any, inner: Any) -> None:
        self.side = side
        self.pool = pool
        self.inner = inner
        self.by_hash: dict[bytes, int] = {}  # store_policy "eviction" only

    def stored(self, block_hashes: list[bytes], parent: bytes | None) -> None:
        if self.inner is not None:
            self.inner.stored(block_hashes, parent)
        store, cached = self.side.store, self.pool.cached
        if self.side.evict_mode:
            for h in block_hashes:
                self.by_hash[h] = cached[h].block_id
            return
        jobs = self.side.new_stores
        for h in block_hashes:
            if store.wants(h):
                job = StoreJob(cached[h].block_id, h)
                if store.register(job):  # pending from now: an eviction cancels it
                    jobs.append(job)

    def removed(self, block_hash: bytes) -> None:
        if self.inner is not None:
            self.inner.removed(block_hash)
        if self.side.evict_mode:
            block_id = self.by_hash.pop(block_hash, None)
            store = self.side.store
            if block_id is not None and store.wants(block_hash):
                job = StoreJob(block_id, block_hash)
                if store.register(job):
                    self.side.evict_stores.append(job)
            return
        self.side.store.cancel(block_hash)  # its store, queued or not yet, is void
        if self.side.tp:  # on every rank: one may still copy what rank 0 committed
            self.side.cancels.append(block_hash)

    def cleared(self) -> None:
        if self.inner is not None:
            self.inner.cleared()
        self.by_hash.clear()
        self.side.store.cancel_all()

    def __getattr__(self, name: str) -> Any:  # drain, snapshot, seq, ... of the recorder
        return getattr(self.inner, name)


class TierSchedulerSide(KVConnectorSchedulerSide):
    def __init__(self, store: TierStore, config: TierConfig) -> None:
        self.store = store
        self.block_size = config.block_size
        self.load_timeout_s = config.load_timeout_s
        self.evict_mode = config.store_policy == "eviction"
        self._matched: dict[str, tuple[int, int]] = {}  # req -> (first block, count)
        self.loading: dict[str, LoadJob] = {}
        self.new_stores: list[StoreJob] = []
        self.evict_stores: list[StoreJob] = []
        self._new_loads: list[LoadJob] = []
        self._landed: set[str] = set()  # loads reported this step (loads_from_own_tiers)
        # tensor parallelism: what ranks > 0 must repeat on their own tiers (TierMeta)
        self.tp = config.tp_size > 1
        self.cancels: list[bytes] = []
        self.aborted: list[str] = []
        self.drops: list[bytes] = []
        self._resets = 0.0  # the store's reset count the ranks have heard of

    def attach(self, pool: Any) -> None:
        """Follow ``pool``'s published and evicted blocks (call after the KV events
        recorder, if any, is in place)."""
        if not isinstance(pool.events, TierPoolEvents):
            if pool.events is not None:  # routing: the tiers' blocks are KV events too
                pool.events.tiers = self.store
                self.store.enable_events()
            pool.events = TierPoolEvents(self, pool, pool.events)

    def get_num_new_matched_tokens(
        self, request: Any, num_local_computed_tokens: int, remote_ok: bool = False
    ):
        """``remote_ok``: match a request whose KV a peer would send too (chain.py asks
        whether the tiers could spare the READ)."""
        rid = request.request_id
        self._matched.pop(rid, None)
        params = request.kv_transfer_params
        remote = bool(params and params.get("do_remote_prefill"))
        if (remote and not remote_ok) or self.store.kv is None:
            return 0, False  # its KV comes from a prefill engine (kvtransfer/tiers/chain.py)
        if request.sampling_params.prompt_logprobs is not None and not request.num_output_tokens:
            return 0, False  # every prompt token's logits are computed
        bs = self.block_size
        max_blocks = (request.num_tokens - 1) // bs  # the last token is always computed
        start = num_local_computed_tokens // bs
        hashes = request.block_hashes
        if start >= max_blocks or len(hashes) < max_blocks:
            return 0, False
        n = self.store.match(hashes[start:max_blocks])
        if not n:
            return 0, False
        self._matched[rid] = (start, n)
        return n * bs, True

    def forget_match(self, request_id: str) -> None:
        self._matched.pop(request_id, None)

    def update_state_after_alloc(self, request: Any, block_ids: list[int], num_external: int):
        matched = self._matched.pop(request.request_id, None)
        if not num_external or matched is None:
            return
        start, n = matched
        keys = list(request.block_hashes[start : start + n])
        job = LoadJob(
            request.request_id,
            keys,
            block_ids[start : start + n],
            time.monotonic() + self.load_timeout_s,
        )
        self.store.pin(keys)
        self.loading[request.request_id] = job
        self._new_loads.append(job)

    def loads_from_own_tiers(self, request: Any) -> bool:
        """Is ``request``'s KV load (admitted, or landing now) from this engine's tiers?
        The scheduler counts those tokens as cached and always recomputes a bad block."""
        rid = request.request_id
        return rid in self._matched or rid in self.loading or rid in self._landed

    def build_connector_meta(self, scheduler_output: Any) -> TierMeta:
        self._landed.clear()
        meta = TierMeta(
            loads=self._new_loads, stores=self.new_stores, evict_stores=self.evict_stores
        )
        self._new_loads, self.new_stores, self.evict_stores = [], [], []
        if self.tp:
            resets = self.store.counters.get("resets", 0.0)
            meta.cancels, meta.aborted, meta.drops = self.cancels, self.aborted, self.drops
            meta.reset, self._resets = resets != self._resets, resets
            self.cancels, self.aborted, self.drops = [], [], []
        return meta

    def request_finished(self, request: Any, block_ids: list[int]):
        self._matched.pop(request.request_id, None)
        job = self.loading.get(request.request_id)
        if job is not None:
            job.cancelled = True  # aborted mid-load: stop copying; blocks freed when it ends
            if self.tp:
                self.aborted.append(request.request_id)
        return False, None

    def update_connector_output(self, connector_output: Any) -> None:
        invalid = set(connector_output.invalid_block_ids) if self.tp else ()
        for rid in connector_output.finished_recving:
            job = self.loading.pop(rid, None)
            if job is not None:
                self._landed.add(rid)
                if invalid:
                    self._forget_failed(job, invalid)

    def _forget_failed(self, job: LoadJob, invalid: set[int]) -> None:
        """Tensor parallelism: a block some rank could not load (missing, corrupt or
        late there) is forgotten on every rank, so its recomputation stores it again
        everywhere (else rank 0 would keep matching a key another rank lacks)."""
        for key, block_id in zip(job.keys, job.block_ids, strict=True):
            if block_id in invalid:
                forget(self.store, [key])
                self.drops.append(key)
                return

    def has_pending_work(self) -> bool:
        return bool(self.loading)

    def check_integrity(self, idle: bool = True) -> None:
        if idle:
            assert not self.loading, f"tier loads still tracked: {sorted(self.loading)}"
            assert not self.aborted, f"aborted tier loads not told to the ranks: {self.aborted}"


class TierWorkerSide(KVConnectorWorkerSide):
    def __init__(self, store: TierStore) -> None:
        self.store = store
        self._step_stores: list[list[StoreJob]] = []  # per launched step, oldest first
        self._bad: set[int] = set()

    def register_kv_caches(self, kv_cache: Any) -> None:
        self.store.open(kv_cache, STORAGE_ORDER[self.store.config.kv_layout])

    def start_load_kv(self, metadata: TierMeta) -> None:
        store = self.store
        for job in metadata.evict_stores:  # must be copied before this step reuses them
            store.store_now(job)
        for job in metadata.loads:
            store.submit_load(job)
        self._step_stores.append(metadata.stores)

    def get_finished(self) -> tuple[set[str], set[str]]:
        if self._step_stores:  # the oldest launched step has run: its blocks are computed
            self.store.submit_stores(self._step_stores.pop(0))
        done = set()
        for rid, bad in self.store.poll():
            done.add(rid)
            self._bad.update(bad)
        return set(), done

    def get_block_ids_with_load_errors(self) -> set[int]:
        bad, self._bad = self._bad, set()
        return bad

    def stats(self) -> dict[str, float]:
        return self.store.stats()

    def shutdown(self) -> None:
        self.store.close()


def create_tier_connector(config: TierConfig) -> tuple[TierSchedulerSide, TierWorkerSide]:
    store = TierStore(config)
    return TierSchedulerSide(store, config), TierWorkerSide(store)
