"""Peers of a decode worker: prefill engine ranks it has handshaked with.

Cached per ``(engine_id, epoch, rank)``: with tensor parallelism each rank
of a prefill engine is its own NIXL agent with its own side channel, and a
decode rank handshakes only with the ranks its read plan names
(``tp_plan.py``). A newer epoch for an engine id means it
restarted: the old entries are dropped (``remove_remote_agent``) so a
restarted peer is never served from stale NIXL state; params that still
name an older epoch are refused. Handshakes (ZMQ request + compat check +
``add_remote_agent``) run on a small thread pool; everything else here runs
on the loop thread, which collects finished handshakes with ``poll()``.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
from typing import Any

import zmq

from tandem.kvtransfer.compat import KVLayout, RankLayout, compat_hash, describe_mismatch
from tandem.kvtransfer.nixl_agent import NixlAgent
from tandem.kvtransfer.nixl_meta import PeerAddr
from tandem.kvtransfer.side_channel import HandshakeError, RegionInfo, fetch_handshake
from tandem.kvtransfer.tp_plan import shard_for
from tandem.wire.auth import PlaneAuth
from tandem.wire.frames import FrameCounters

logger = logging.getLogger(__name__)

PeerKey = tuple[str, int, int]  # engine id, epoch, rank


class IncompatiblePeerError(HandshakeError):
    """The peer's KV blocks do not mean the same bytes as ours."""


@dataclasses.dataclass
class Peer:
    addr: PeerAddr
    rank: int = 0
    future: concurrent.futures.Future | None = None
    agent_name: str = ""
    region: RegionInfo | None = None
    shard: RankLayout | None = None  # the heads this rank holds (from its handshake)
    host_region: RegionInfo | None = None  # its host KV tier, if it has one registered
    # NIXL forgot the peer's agent (or never knew it): none of its READs can land any more
    agent_removed: bool = False
    # loads / notifies queued until the handshake finishes (owned by the worker)
    waiting: list[Any] = dataclasses.field(default_factory=list)

    @property
    def key(self) -> PeerKey:
        return (self.addr.engine_id, self.addr.epoch, self.rank)

    @property
    def ready(self) -> bool:
        return bool(self.agent_name)


class PeerTable:
    def __init__(
        self,
        agent: NixlAgent,
        context: zmq.Context,
        local_engine_id: str,
        handshake_timeout_s: float,
        max_concurrent_handshakes: int = 4,
        *,
        auth: PlaneAuth | None = None,
        malformed: FrameCounters | None = None,
    ) -> None:
        self._auth = auth
        self._malformed = malformed
        self._agent = agent
        self._local_engine_id = local_engine_id
        self._timeout_s = handshake_timeout_s
        self._context = context
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=max_concurrent_handshakes, thread_name_prefix="kv-handshake"
        )
        self._peers: dict[PeerKey, Peer] = {}
        self._latest_epoch: dict[str, int] = {}
        # handshakes of dropped peers still running: their agents must be removed
        self._orphans: list[concurrent.futures.Future] = []
        self._layout: KVLayout | None = None
        self._hash = ""
        self._head_block_bytes = 0
        self.num_handshakes = 0
        self.num_handshake_failures = 0

    def set_local_layout(self, layout: KVLayout, head_block_bytes: int) -> None:
        """``head_block_bytes``: one KV head of one block (what every rank of a
        compatible peer holds a whole multiple of)."""
        self._layout, self._hash = layout, compat_hash(layout)
        self._head_block_bytes = head_block_bytes

    def lookup(self, addr: PeerAddr, rank: int = 0) -> tuple[Peer | None, list[Peer], str]:
        """``(peer, dropped, error)`` for rank ``rank`` of the engine at ``addr``.
        Starts a handshake for an unknown peer.
        ``dropped`` are older incarnations removed now (the caller fails their
        work); ``error`` (with peer None) means ``addr`` names a stale epoch."""
        latest = self._latest_epoch.get(addr.engine_id)
        if latest is not None and addr.epoch < latest:
            return (
                None,
                [],
                (
                    f"prefill engine {addr.engine_id} restarted: epoch {addr.epoch} is stale "
                    f"(latest seen {latest})"
                ),
            )
        dropped: list[Peer] = []
        if latest is None or addr.epoch > latest:
            dropped = self.drop_engine(addr.engine_id)
            self._latest_epoch[addr.engine_id] = addr.epoch
        peer = self._peers.get((addr.engine_id, addr.epoch, rank))
        if peer is None:
            peer = Peer(addr, rank, future=self._executor.submit(self._handshake, addr, rank))
            self._peers[peer.key] = peer
        return peer, dropped, ""

    def find(self, addr: PeerAddr, rank: int) -> Peer | None:
        """The known peer for rank ``rank`` of ``addr``'s incarnation; never
        starts a handshake."""
        return self._peers.get((addr.engine_id, addr.epoch, rank))

    def drop_engine(self, engine_id: str) -> list[Peer]:
        """Forget every incarnation of ``engine_id``; returns them."""
        dropped = [p for key, p in self._peers.items() if key[0] == engine_id]
        for peer in dropped:
            self.invalidate(peer)
        return dropped

    def invalidate(self, peer: Peer) -> None:
        """Forget ``peer`` (transfer error, peer gone, restart); the next
        request that names it handshakes again."""
        if self._peers.get(peer.key) is peer:
            del self._peers[peer.key]
        if peer.future is not None:
            self._orphans.append(peer.future)
            peer.future = None
        if peer.ready:
            if self._remove_agent(peer.agent_name):
                peer.agent_removed = True
                peer.agent_name = ""
            # else the name is kept: invalidating again retries the removal
        else:
            peer.agent_removed = True  # no READ was ever posted to it

    def poll(self) -> tuple[list[Peer], list[tuple[Peer, str]]]:
        """Collect finished handshakes: ``(now_ready, failed_with_reason)``.
        Failed peers are forgotten (the next request retries)."""
        ready: list[Peer] = []
        failed: list[tuple[Peer, str]] = []
        for peer in list(self._peers.values()):
            if peer.future is None or not peer.future.done():
                continue
            future, peer.future = peer.future, None
            try:
                peer.agent_name, peer.region, peer.shard, peer.host_region = future.result()
                self.num_handshakes += 1
                ready.append(peer)
            except Exception as e:
                self.num_handshake_failures += 1
                del self._peers[peer.key]
                addr = peer.addr
                port = addr.rank_port(peer.rank)
                reason = (
                    f"handshake with {addr.engine_id} rank {peer.rank}@{addr.host}:{port} "
                    f"failed: {e}"
                )
                logger.warning(reason)
                failed.append((peer, reason))
        for future in [f for f in self._orphans if f.done()]:
            self._orphans.remove(future)
            if not future.cancelled() and future.exception() is None:
                self._remove_agent(future.result()[0])
        return ready, failed

    def _handshake(
        self, addr: PeerAddr, rank: int
    ) -> tuple[str, RegionInfo, RankLayout, RegionInfo | None]:
        """Runs on a pool thread: the only NIXL calls are in ``NixlAgent.add_peer`` (locked)."""
        port = addr.rank_port(rank)
        info = fetch_handshake(
            self._context,
            addr.host,
            port,
            self._local_engine_id,
            self._timeout_s,
            auth=self._auth,
            malformed=self._malformed,
        )
        if info.engine_id != addr.engine_id:
            raise HandshakeError(
                f"{addr.host}:{port} is engine {info.engine_id!r}, expected {addr.engine_id!r}"
            )
        if info.epoch != addr.epoch:
            raise HandshakeError(
                f"engine {addr.engine_id} is at epoch {info.epoch}, the request names epoch "
                f"{addr.epoch} (the engine restarted; its KV is gone)"
            )
        if self._layout is None:
            raise HandshakeError("local KV cache not registered")
        if info.compat_hash != self._hash:
            raise IncompatiblePeerError(
                f"engine {addr.engine_id} has incompatible KV blocks: "
                f"{describe_mismatch(self._layout, info.layout)}"
            )
        shard = info.rank
        if (shard.rank, shard.tp_size) != (rank, addr.tp_size):
            raise HandshakeError(
                f"{addr.host}:{port} is rank {shard.rank} of {shard.tp_size}, expected rank "
                f"{rank} of {addr.tp_size} (engine {addr.engine_id})"
            )
        expected = shard_for(self._layout.num_kv_heads, shard.tp_size, shard.rank)
        if shard != expected:
            raise IncompatiblePeerError(
                f"engine {addr.engine_id} rank {rank} holds {shard}, expected {expected}"
            )
        if info.region.block_len != self._head_block_bytes * shard.num_heads:
            raise IncompatiblePeerError(
                f"engine {addr.engine_id} rank {rank} blocks are {info.region.block_len} bytes, "
                f"expected {self._head_block_bytes * shard.num_heads} for {shard.num_heads} heads"
            )
        host = info.host_region
        if host is not None and host.block_len != info.region.block_len:
            host = None  # not whole blocks of ours: its host tier is not readable
        name = self._agent.add_peer(info.agent_metadata, info.region)
        return name, info.region, shard, host

    def _remove_agent(self, agent_name: str) -> bool:
        """True once NIXL no longer knows the agent (removed now or before)."""
        try:
            self._agent.remove_peer(agent_name)
            return True
        except Exception as e:
            logger.warning("remove_remote_agent(%s) refused: %s", agent_name, e)
            return False

    def peers_with_waiting(self) -> list[Peer]:
        return [p for p in self._peers.values() if p.waiting]

    @property
    def num_pending(self) -> int:
        return sum(1 for p in self._peers.values() if p.future is not None) + len(self._orphans)

    def close(self) -> bool:
        """Drop every peer; never waits for a running handshake. Idempotent.
        Returns False while a handshake thread may still use the ZMQ context."""
        for peer in list(self._peers.values()):
            self.invalidate(peer)
        self._executor.shutdown(wait=False, cancel_futures=True)
        return all(f.done() for f in self._orphans)
