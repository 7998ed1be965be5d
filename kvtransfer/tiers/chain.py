"""A peer connector (NIXL, prefill/decode pools) and the KV tiers in one engine.

    get_num_new_matched_tokens   the peer first (a decode request reads the prefill
                                 engine's blocks); what it does not load, the tiers may;
                                 a request the peer would load whose every full block
                                 the tiers hold is the tiers' (the READ is skipped, the
                                 peer told "done" at once)
    update_state_after_alloc     to the side that claimed the request; the peer also
                                 hears of every other request (it may notify a peer)
    build_connector_meta         ChainMeta(peer meta, tier meta)
    worker side                  both halves; finished sets and bad blocks are unions

So a prefill engine's prompt found in its own tiers is loaded, not computed, before
its KV is handed to the decode engine, and counts as cached tokens there. The host
tier is registered with the peer connector's NIXL agent, and a prefix in it can be
lent to another engine's READ (``export_host_prefix``, export.py).
"""

from __future__ import annotations

from typing import Any

import msgspec

from tandem.kvtransfer.base import KVConnectorSchedulerSide, KVConnectorWorkerSide
from tandem.kvtransfer.tiers.connector import TierSchedulerSide, TierWorkerSide
from tandem.kvtransfer.tiers.export import TierExports


class ChainMeta(msgspec.Struct):
    peer: Any = None
    tiers: Any = None

    @property
    def loads(self) -> bool:
        """Whether this step starts a load (the runner orders it after the step in flight)."""
        return bool(getattr(self.peer, "loads", True)) or bool(self.tiers.loads)


class ChainedSchedulerSide(KVConnectorSchedulerSide):
    def __init__(self, peer: KVConnectorSchedulerSide, tiers: TierSchedulerSide) -> None:
        self.peer = peer
        self.tiers = tiers
        self._claimed: set[str] = set()  # requests the tiers load
        self.num_reads_skipped = 0  # peer READs a tier load replaced
        store = tiers.store
        self.exports = TierExports(store, tiers.block_size, store.config.engine_id)

    def export_host_prefix(self, block_hashes: list[bytes]) -> dict[str, Any] | None:
        """Lend the leading ``block_hashes`` of the host tier to a peer's READ: the
        params of the reading engine's request, or None (export.py)."""
        return self.exports.export(self.peer, block_hashes)

    def __getattr__(self, name: str) -> Any:  # set_prefill_endpoints, ... of the peer
        return getattr(self.peer, name)

    @property
    def loading(self) -> dict:
        return self.tiers.loading

    def attach(self, pool: Any) -> None:
        self.tiers.attach(pool)

    def loads_from_own_tiers(self, request: Any) -> bool:
        lent = getattr(self.peer, "loads_from_own_tiers", None)  # a peer's host tier
        return self.tiers.loads_from_own_tiers(request) or bool(lent and lent(request))

    def get_num_new_matched_tokens(self, request: Any, num_local_computed_tokens: int):
        rid = request.request_id
        self._claimed.discard(rid)
        n, load_async = self.peer.get_num_new_matched_tokens(request, num_local_computed_tokens)
        if n and load_async:
            # this engine's own tiers may hold what the READ would bring (a decode engine
            # served this prompt before): load it from them, the peer hears "done" at once
            t, _ = self.tiers.get_num_new_matched_tokens(
                request, num_local_computed_tokens, remote_ok=True
            )
            full = (num_local_computed_tokens + n) // self.tiers.block_size
            if t and num_local_computed_tokens + t >= full * self.tiers.block_size:
                self._claimed.add(rid)
                self.num_reads_skipped += 1
                return t, True
            self.tiers.forget_match(rid)
        if n or load_async:
            return n, load_async
        n, load_async = self.tiers.get_num_new_matched_tokens(request, num_local_computed_tokens)
        if n:
            self._claimed.add(rid)
        return n, load_async

    def update_state_after_alloc(self, request: Any, block_ids: list[int], num_external: int):
        if request.request_id in self._claimed:
            self._claimed.discard(request.request_id)
            self.tiers.update_state_after_alloc(request, block_ids, num_external)
            self.peer.update_state_after_alloc(request, block_ids, 0)
        else:
            self.peer.update_state_after_alloc(request, block_ids, num_external)

    def build_connector_meta(self, scheduler_output: Any) -> ChainMeta:
        return ChainMeta(
            self.peer.build_connector_meta(scheduler_output),
            self.tiers.build_connector_meta(scheduler_output),
        )

    def request_finished(self, request: Any, block_ids: list[int]):
        self._claimed.discard(request.request_id)
        self.tiers.request_finished(request, block_ids)
        return self.peer.request_finished(request, block_ids)

    def cancel_send(self, request_id: str) -> None:
        self.peer.cancel_send(request_id)

    def update_connector_output(self, connector_output: Any) -> None:
        self.peer.update_connector_output(connector_output)
        self.tiers.update_connector_output(connector_output)
        self.exports.finished(list(connector_output.finished_sending))

    def has_pending_work(self) -> bool:
        return self.peer.has_pending_work() or self.tiers.has_pending_work()

    def check_integrity(self, idle: bool = True) -> None:
        self.tiers.check_integrity(idle)
        self.exports.check_integrity(idle)
        if idle:
            assert not self._claimed, f"tier claims left: {sorted(self._claimed)}"


class ChainedWorkerSide(KVConnectorWorkerSide):
    def __init__(self, peer: KVConnectorWorkerSide, tiers: TierWorkerSide) -> None:
        self.peer = peer
        self.tiers = tiers
        self.store = tiers.store

    def __getattr__(self, name: str) -> Any:  # side_channel_port, wire_stats, ... of the peer
        return getattr(self.peer, name)

    def register_kv_caches(self, kv_cache: Any) -> None:
        self.tiers.register_kv_caches(kv_cache)  # allocates the host tier
        set_host_tier = getattr(self.peer, "set_host_tier", None)  # NIXL
        if self.store.host is not None and set_host_tier is not None:
            set_host_tier(self.store.host.data)  # registered with the cache, one handshake
        self.peer.register_kv_caches(kv_cache)

    def start_load_kv(self, metadata: ChainMeta) -> None:
        if metadata.peer is not None:
            self.peer.start_load_kv(metadata.peer)
        self.tiers.start_load_kv(metadata.tiers)

    def get_finished(self) -> tuple[set[str], set[str]]:
        sending, recving = self.peer.get_finished()
        _, tier_recving = self.tiers.get_finished()
        return sending, recving | tier_recving

    def get_block_ids_with_load_errors(self) -> set[int]:
        return (
            self.peer.get_block_ids_with_load_errors() | self.tiers.get_block_ids_with_load_errors()
        )

    def stats(self) -> dict[str, float]:
        return self.peer.stats()

    def shutdown(self) -> None:
        self.tiers.shutdown()
        self.peer.shutdown()
