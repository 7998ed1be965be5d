"""A prefix of this engine's host tier lent to another engine's NIXL READ.

    router/gateway: the prompt's prefix is in engine A's host tier only; B is chosen
    A  kv_tier_export(block hashes)   (utility, A's loop thread)
         leading hashes in A's host tier -> keys pinned (no eviction, no reuse of the
         slots), a send held by A's NIXL side under an export id with a lease
         -> KVTransferParams(do_remote_prefill, remote_block_ids = host slots,
                             remote_medium "host", num_tokens = blocks * block_size)
    B  EngineRequest(prompt, kv_transfer_params=those)
         the prefill -> decode READ path: WAITING_FOR_REMOTE_KVS, one READ of the slots
         (A's host tier is registered with A's agent, nixl_agent.register_host), the
         rest of the prompt computed; a failed or late READ is recomputed
         "done" -> A: finished_sending(export id) -> keys unpinned
    A  the lease ends without "done" (B gone) -> the same

The slots hold whole blocks in the device cache's storage order, so a slot READs
into a block like a block does. Pinned keys stay in their slots: the host tier
evicts only unpinned entries, a reset skips them, and only a load that finds a
checksum mismatch drops an entry, which a pinned export never reaches (A reads
nothing of it).
"""

from __future__ import annotations

import itertools
import logging
from typing import Any

from tandem.kvtransfer.tiers.store import TierStore

logger = logging.getLogger(__name__)

_ids = itertools.count()


class TierExports:
    def __init__(self, store: TierStore, block_size: int, engine_id: str) -> None:
        self.store = store
        self.block_size = block_size
        self.engine_id = engine_id
        self.held: dict[str, list[bytes]] = {}  # export id -> keys pinned for it

    def export(self, peer: Any, block_hashes: list[bytes]) -> dict[str, Any] | None:
        """Pin the leading ``block_hashes`` this engine's host tier holds and hold them
        for a peer's READ (``peer``: the NIXL scheduler side, ``hold_blocks``); the
        params for the reading engine's request, or None when the tier holds none."""
        if self.store.host is None or self.store.kv is None:
            return None
        keys, slots = self.store.pin_host_prefix(block_hashes)
        if not keys:
            return None
        export_id = f"tier-export-{self.engine_id}-{next(_ids)}"
        try:
            params = peer.hold_blocks(
                export_id, slots, len(slots) * self.block_size, remote_medium="host"
            )
        except BaseException:
            self.store.unpin(keys)
            raise
        self.held[export_id] = keys
        self.store.counters["host_exports"] += 1
        self.store.counters["host_exported_blocks"] += len(keys)
        return params

    def finished(self, export_ids: list[str]) -> None:
        """The peer said "done", or the lease ended: the keys may leave the tier again."""
        for export_id in export_ids:
            keys = self.held.pop(export_id, None)
            if keys is not None:
                self.store.unpin(keys)

    def check_integrity(self, idle: bool = True) -> None:
        if idle:
            assert not self.held, f"host tier exports still held: {sorted(self.held)}"
