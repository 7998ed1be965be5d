"""KV events: what an engine's prefix cache gained and lost, for the router.

    block pool --stored/removed/cleared--> KVEventRecorder (this step's events)
    engine loop, after each step: recorder.drain() -> one KVEventBatch
    workers/engine/kv_events_publisher.py: bounded queue -> ZMQ PUB
        ==>  gateway SUB (cluster/routing/subscriber.py)

Field meaning follows vLLM's ``KVEventBatch``:

    BlockStored(block_hashes, parent_block_hash, num_tokens)
        full blocks just published in the prefix cache, in prompt order;
        ``parent_block_hash`` is the hash before the first of them (None at
        the start of a prompt), ``num_tokens`` = len(block_hashes) * block size.
    BlockRemoved(block_hashes)   evicted (their block was reused)
    AllBlocksCleared()           the whole cache was forgotten (reset)

Both block events end with ``medium``, as vLLM's do: "device" (the KV cache; the
default, so a batch from before the field decodes as device), "host" or "disk"
(the engine's KV tiers, kvtransfer/tiers/: a block stored below the device or
evicted from that tier). A tier's ``BlockStored`` names no parent (its blocks are
stored one by one, off the step: consecutive ones of a medium share an event) and
``AllBlocksCleared`` is the device's only.

A batch carries ``engine_id``, ``epoch`` (one per engine incarnation: a
restarted engine starts an empty cache under a new epoch) and ``seq``, which
counts batches from 1 within an epoch. A subscriber that sees ``seq`` jump
has lost batches (the publisher's queue overflowed, or the PUB socket
dropped them) and must resync from a snapshot: ``KVEventRecorder.snapshot``
answers ``(epoch, seq of the last batch drained, every cached hash)`` on the
engine loop thread, so batches with ``seq`` above it apply on top.

Events are off unless routing needs them: with no recorder attached the
block pool does nothing extra.
"""

from __future__ import annotations

from typing import Any

import msgspec

from tandem.scheduler.block_hash import BlockHash

DEVICE = "device"
MEDIA = (DEVICE, "host", "disk")


class BlockStored(msgspec.Struct, tag=True, array_like=True):
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    num_tokens: int
    medium: str = DEVICE  # appended: older batches decode as device


class BlockRemoved(msgspec.Struct, tag=True, array_like=True):
    block_hashes: list[bytes]
    medium: str = DEVICE  # appended: older batches decode as device


class AllBlocksCleared(msgspec.Struct, tag=True, array_like=True):
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True):
    engine_id: str
    epoch: int
    seq: int
    ts_s: float
    events: list[KVEvent]


class KVSnapshot(msgspec.Struct, array_like=True):
    """Every hash the engine's cache holds after batch ``seq`` of ``epoch``
    (``tier_block_hashes``: per tier medium, the hashes its KV tiers hold)."""

    engine_id: str
    epoch: int
    seq: int
    block_hashes: list[bytes]
    tier_block_hashes: dict[str, list[bytes]] = {}  # appended


class KVEventRecorder:
    """Collects one step's cache changes. Called by the block pool (engine
    loop thread only); ``drain`` turns them into the step's batch."""

    def __init__(self, engine_id: str, epoch: int, block_size: int) -> None:
        self.engine_id = engine_id
        self.epoch = epoch
        self.block_size = block_size
        self.seq = 0  # of the last batch drained
        self._events: list[KVEvent] = []
        self._removed: list[bytes] = []
        self._tier_removed: dict[str, list[bytes]] = {}  # per medium, merged like _removed
        # the engine's KV tiers (kvtransfer/tiers/ TierStore: take_events, tier_hashes),
        # whose changes each drain picks up; None without tiers
        self.tiers: Any = None

    def stored(self, block_hashes: list[BlockHash], parent: BlockHash | None) -> None:
        if not block_hashes:
            return
        self._flush_removed()
        self._events.append(BlockStored(block_hashes, parent, len(block_hashes) * self.block_size))

    def removed(self, block_hash: BlockHash) -> None:
        self._removed.append(block_hash)  # evictions come one by one: merge them

    def cleared(self) -> None:
        self._removed.clear()
        self._events.append(AllBlocksCleared())

    def tier_changed(self, medium: str, block_hash: BlockHash, stored: bool) -> None:
        """A KV tier (``medium`` "host" or "disk") stored or dropped a block (the
        tiers hand their changes over on the loop thread, kvtransfer/tiers/)."""
        if stored:
            self._flush_removed()
            last = self._events[-1] if self._events else None
            if isinstance(last, BlockStored) and last.medium == medium:  # one event a run
                last.block_hashes.append(block_hash)
                last.num_tokens += self.block_size
                return
            self._events.append(BlockStored([block_hash], None, self.block_size, medium))
        else:
            self._tier_removed.setdefault(medium, []).append(block_hash)

    def _flush_removed(self) -> None:
        if self._removed:
            self._events.append(BlockRemoved(self._removed))
            self._removed = []
        for medium, hashes in self._tier_removed.items():
            self._events.append(BlockRemoved(hashes, medium))
        self._tier_removed = {}

    def drain(self, ts_s: float) -> KVEventBatch | None:
        """This step's events as one batch (None if nothing changed)."""
        if self.tiers is not None:
            for medium, block_hash, stored in self.tiers.take_events():
                self.tier_changed(medium, block_hash, stored)
        self._flush_removed()
        if not self._events:
            return None
        self.seq += 1
        batch = KVEventBatch(self.engine_id, self.epoch, self.seq, ts_s, self._events)
        self._events = []
        return batch

    def snapshot(self, cached_hashes: list[BlockHash]) -> KVSnapshot:
        """Call between steps (after ``drain``): the cache (and its tiers') as of
        batch ``seq``. A tier change after the drain may be in the snapshot and in
        the next batch too: applying a block event twice changes nothing."""
        assert not self._events and not self._removed, "snapshot with undrained events"
        assert not self._tier_removed, "snapshot with undrained events"
        tiers = self.tiers.tier_hashes() if self.tiers is not None else {}
        return KVSnapshot(self.engine_id, self.epoch, self.seq, list(cached_hashes), tiers)
