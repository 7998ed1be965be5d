"""Cluster prefix index: block hash -> engines that hold the block.

    engine A (prefill, epoch 7, seq 41)   hashes {h0, h1, h2}    LRU order
    engine B (decode,  epoch 3, seq 12)   hashes {h0, h5}
    where: h0 -> {A, B}, h1 -> {A}, h2 -> {A}, h5 -> {B}

Fed by ``KVEventBatch`` es (``apply``) and ``KVSnapshot`` s (``load_snapshot``).
Per engine it keeps the epoch and the seq of the last batch applied:

* a batch of a newer epoch means the engine restarted: its old entries are
  dropped before the batch applies (and if the batch is not seq 1 of that
  epoch, the engine needs a resync);
* a batch of an older epoch, or a seq already applied, is ignored;
* a seq jump is a gap: the engine is marked ``needs_resync`` and its batches
  are ignored until ``load_snapshot`` replaces its entries.

Memory is bounded: an engine never holds more than ``capacity_blocks``
hashes here (its KV block count, from ``ready``). Events keep the set exact;
if removals were lost the least recently stored hashes go first.

Below the device (KV tiers, kvtransfer/tiers/): events whose ``medium`` is
"host" or "disk" go to the engine's per-medium sets, apart from its device
hashes, so ``match`` stays the device's answer and ``match_below`` adds what the
engine's own tiers hold and what any other engine's host tier holds (which it
can READ over NIXL). A tier set is bounded by ``MAX_TIER_BLOCKS`` the same way.

The index is touched only from the gateway's event loop thread.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from tandem.scheduler.kv_events import (
    DEVICE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVSnapshot,
)

TIER_MEDIA = ("host", "disk")
MAX_TIER_BLOCKS = 1_000_000  # per engine and medium: ~100 MB of index at most


@dataclass
class IndexedEngine:
    engine_id: str
    role: str
    capacity_blocks: int
    epoch: int = 0
    seq: int = 0
    needs_resync: bool = True  # nothing known until seq 1 or a snapshot
    hashes: OrderedDict[bytes, None] = field(default_factory=OrderedDict)
    # below the device: medium ("host", "disk") -> hashes its KV tier holds, LRU order
    tiers: dict[str, OrderedDict[bytes, None]] = field(
        default_factory=lambda: {m: OrderedDict() for m in TIER_MEDIA}
    )


class PrefixIndex:
    def __init__(self) -> None:
        self.engines: dict[str, IndexedEngine] = {}
        self._where: dict[bytes, set[str]] = {}
        self._tier_where: dict[str, dict[bytes, set[str]]] = {m: {} for m in TIER_MEDIA}
        self.num_gaps = 0
        self.num_resyncs = 0
        self.num_lru_evictions = 0

    def add_engine(self, engine_id: str, role: str, capacity_blocks: int) -> None:
        """Register (or re-size) an engine; its entries are kept."""
        if capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be >= 1, got {capacity_blocks}")
        e = self.engines.get(engine_id)
        if e is None:
            self.engines[engine_id] = IndexedEngine(engine_id, role, capacity_blocks)
        else:
            e.capacity_blocks = capacity_blocks
            self._trim(e)

    def remove_engine(self, engine_id: str) -> None:
        """The engine left the cluster (a pool scaled in): its entries go."""
        e = self.engines.pop(engine_id, None)
        if e is not None:
            self._clear(e)

    # ---- updates ---------------------------------------------------------------

    def apply(self, batch: KVEventBatch) -> bool:
        """Apply one batch. Returns False when the engine needs a snapshot
        (first contact mid-stream, a gap, or a restart seen mid-stream)."""
        e = self.engines.get(batch.engine_id)
        if e is None:
            return True  # not an engine of this cluster: ignore
        if batch.epoch < e.epoch:
            return True  # a previous incarnation's late batch
        if batch.epoch > e.epoch:
            self._clear(e)
            e.epoch, e.seq = batch.epoch, 0
            e.needs_resync = batch.seq != 1
        if e.needs_resync and batch.seq != 1:
            return False
        if batch.seq <= e.seq:
            return True  # already applied (replayed after a snapshot)
        if batch.seq != e.seq + 1:
            self.num_gaps += 1
            e.needs_resync = True
            return False
        e.needs_resync = False
        e.seq = batch.seq
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                if ev.medium != DEVICE:
                    self._add_tier(e, ev.medium, ev.block_hashes)
                    continue
                for h in ev.block_hashes:
                    self._add(e, h)
            elif isinstance(ev, BlockRemoved):
                if ev.medium != DEVICE:
                    self._discard_tier(e, ev.medium, ev.block_hashes)
                    continue
                for h in ev.block_hashes:
                    self._discard(e, h)
            elif isinstance(ev, AllBlocksCleared):  # the device's cache only
                for h in list(e.hashes):
                    self._discard(e, h)
        self._trim(e)
        return True

    def load_snapshot(self, snap: KVSnapshot) -> None:
        """Replace an engine's entries with its snapshot (after a gap or restart)."""
        e = self.engines.get(snap.engine_id)
        if e is None or snap.epoch < e.epoch:
            return
        self._clear(e)
        e.epoch, e.seq, e.needs_resync = snap.epoch, snap.seq, False
        for h in snap.block_hashes:
            self._add(e, h)
        for medium, hashes in snap.tier_block_hashes.items():
            self._add_tier(e, medium, hashes)
        self._trim(e)
        self.num_resyncs += 1

    def drop_engine_state(self, engine_id: str, epoch: int) -> None:
        """The engine restarted (new ``epoch`` seen by the health check):
        forget what the old incarnation held."""
        e = self.engines.get(engine_id)
        if e is not None and epoch > e.epoch:
            self._clear(e)
            e.epoch, e.seq, e.needs_resync = epoch, 0, True

    # ---- queries ---------------------------------------------------------------

    def match(self, block_hashes: Sequence[bytes], engine_ids: Sequence[str]) -> dict[str, int]:
        """For each engine in ``engine_ids``: how many leading blocks of
        ``block_hashes`` it holds (0 for an engine mid-resync)."""
        live = {eid for eid in engine_ids if eid in self.engines}
        live -= {eid for eid in live if self.engines[eid].needs_resync}
        out = dict.fromkeys(engine_ids, 0)
        for i, h in enumerate(block_hashes):
            holders = self._where.get(h)
            if not holders:
                break
            live &= holders
            if not live:
                break
            for eid in live:
                out[eid] = i + 1
        return out

    def match_below(
        self, block_hashes: Sequence[bytes], engine_ids: Sequence[str], peers: bool = True
    ) -> dict[str, int]:
        """For each engine in ``engine_ids``: how many leading blocks of ``block_hashes``
        it could have without computing them: on its device, in its own host or disk
        tier, or (``peers``) in another engine's host tier (a NIXL READ away). At
        least ``match``."""
        # an engine awaiting a resync (e.g. one that never stored a block yet) has
        # nothing of its own known here, but may still read a peer's host tier
        known = {eid for eid in engine_ids if eid in self.engines}
        live = [eid for eid in engine_ids if eid in known]
        synced = {eid for eid in known if not self.engines[eid].needs_resync}
        out = dict.fromkeys(engine_ids, 0)
        host, disk = self._tier_where["host"], self._tier_where["disk"]
        for i, h in enumerate(block_hashes):
            in_host = host.get(h, set()) - {
                x for x in host.get(h, ()) if self.engines[x].needs_resync
            }
            others_host = in_host if peers else set()
            own = (self._where.get(h, set()) | disk.get(h, set()) | in_host) & synced
            live = [eid for eid in live if eid in own or others_host - {eid}]
            if not live:
                break
            for eid in live:
                out[eid] = i + 1
        return out

    def host_run(self, engine_id: str, block_hashes: Sequence[bytes]) -> int:
        """How many leading blocks of ``block_hashes`` the engine's host tier holds
        (0 for an engine unknown or awaiting a resync)."""
        e = self.engines.get(engine_id)
        if e is None or e.needs_resync:
            return 0
        host = e.tiers["host"]
        n = 0
        for h in block_hashes:
            if h not in host:
                break
            n += 1
        return n

    def hashes_of(self, engine_id: str, medium: str = DEVICE) -> set[bytes]:
        e = self.engines.get(engine_id)
        if e is None:
            return set()
        return set(e.hashes) if medium == DEVICE else set(e.tiers[medium])

    def num_entries(self) -> int:
        return sum(len(e.hashes) for e in self.engines.values())

    def check_integrity(self) -> None:
        for h, eids in self._where.items():
            assert eids, f"empty holder set for {h.hex()}"
            for eid in eids:
                assert h in self.engines[eid].hashes, f"{eid} missing {h.hex()}"
        for e in self.engines.values():
            assert len(e.hashes) <= e.capacity_blocks, f"{e.engine_id} over capacity"
            for h in e.hashes:
                assert e.engine_id in self._where.get(h, ()), f"{h.hex()} not mapped"
            for medium, hashes in e.tiers.items():
                assert len(hashes) <= MAX_TIER_BLOCKS, f"{e.engine_id} {medium} over capacity"
                for h in hashes:
                    assert e.engine_id in self._tier_where[medium].get(h, ()), (
                        f"{medium} {h.hex()} not mapped"
                    )
        for medium, where in self._tier_where.items():
            for h, eids in where.items():
                assert eids, f"empty {medium} holder set for {h.hex()}"
                for eid in eids:
                    assert h in self.engines[eid].tiers[medium], f"{eid} missing {h.hex()}"

    # ---- internals ---------------------------------------------------------------

    def _add(self, e: IndexedEngine, h: bytes) -> None:
        if h in e.hashes:
            e.hashes.move_to_end(h)
            return
        e.hashes[h] = None
        self._where.setdefault(h, set()).add(e.engine_id)

    def _discard(self, e: IndexedEngine, h: bytes) -> None:
        if e.hashes.pop(h, 0) is None:
            holders = self._where[h]
            holders.discard(e.engine_id)
            if not holders:
                del self._where[h]

    def _add_tier(self, e: IndexedEngine, medium: str, hashes: Sequence[bytes]) -> None:
        held = e.tiers.get(medium)
        if held is None:
            return  # a medium this index does not know: ignored
        where = self._tier_where[medium]
        for h in hashes:
            if h in held:
                held.move_to_end(h)
                continue
            held[h] = None
            where.setdefault(h, set()).add(e.engine_id)
        while len(held) > MAX_TIER_BLOCKS:
            self.num_lru_evictions += 1
            self._discard_tier(e, medium, [next(iter(held))])

    def _discard_tier(self, e: IndexedEngine, medium: str, hashes: Sequence[bytes]) -> None:
        held = e.tiers.get(medium)
        if held is None:
            return
        where = self._tier_where[medium]
        for h in hashes:
            if held.pop(h, 0) is None:
                holders = where[h]
                holders.discard(e.engine_id)
                if not holders:
                    del where[h]

    def _clear(self, e: IndexedEngine) -> None:
        for h in list(e.hashes):
            self._discard(e, h)
        for medium, held in e.tiers.items():
            self._discard_tier(e, medium, list(held))

    def _trim(self, e: IndexedEngine) -> None:
        while len(e.hashes) > e.capacity_blocks:
            self.num_lru_evictions += 1
            self._discard(e, next(iter(e.hashes)))
