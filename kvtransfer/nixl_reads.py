"""Decode role of the NIXL connector: READs of a prefill engine's KV blocks into this rank.

Per LoadSpec (this worker is rank d of a decode engine with tensor-parallel size D; P has size
len(peer.rank_ports) or 1)::

    start_load: read plan (tp_plan.plan_rank_reads): one PART per prefill rank whose heads rank
                d needs (homogeneous TP: rank d only); each part: peer rank ready? -> post its
                READ (descriptors: tp_plan.read_descriptors); handshake pending? -> queue
                (never blocks)
    polls:      handshakes done -> post queued READs; a part DONE / ERR / peer gone /
                deadline / lease -> part over; every part over -> done_recving (+ load-error
                blocks if any part failed), "done" (rank d of D) to P's lead rank, best effort

Quarantine: a load that ends (deadline, peer gone, error) while NIXL refuses to release its
handle could still be written by a late READ. Its request is not reported (so the scheduler
neither frees, reuses, recomputes into nor hashes its blocks) until the READ can no longer
land::

    end of load -> release(handle) ok ------------------------> report
                   refused -> quarantine -> each poll: handle DONE/ERR and
                              released, or the peer's agent removed
                              (remove_remote_agent: NIXL drops the
                              connection and the remote's registration) -> report

A load's deadline is ``min(start + load_timeout_s, lease_deadline)``: past the lease P may
reuse the blocks, so a late read is a failed read.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

from tandem.kvtransfer.compat import KVLayout, RankLayout
from tandem.kvtransfer.config import KVTransferConfig
from tandem.kvtransfer.fault_injection import ReadFaults
from tandem.kvtransfer.nixl_agent import NixlAgent
from tandem.kvtransfer.nixl_meta import NOTIF_DONE, LoadSpec, NotifySpec, PeerAddr
from tandem.kvtransfer.nixl_peers import Peer, PeerTable
from tandem.kvtransfer.nixl_read_ledger import ReadLedger
from tandem.kvtransfer.tp_plan import BlockGeometry, HeadRead, plan_rank_reads, read_descriptors

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class _Load:
    """One part of a request's load: the heads ``read`` names, from one prefill rank."""

    spec: LoadSpec
    deadline_mono: float
    read: HeadRead | None = None  # None: failed before any plan
    peer: Peer | None = None
    handle: Any = None
    start_s: float = 0.0
    num_bytes: int = 0
    num_descriptors: int = 0
    failure: str = ""  # why it failed ("" = the READ completed)

    @property
    def key(self) -> tuple[str, int]:
        return (self.spec.request_id, self.read.src_rank if self.read is not None else -1)


class KVReads:
    """The loads of this rank: planned, queued on handshakes, in flight, quarantined."""

    def __init__(
        self,
        config: KVTransferConfig,
        clock: Callable[[], float],
        agent: NixlAgent,
        peers: PeerTable,
        notify: Callable[..., None],
        counters: dict[str, Any],
    ) -> None:
        self.config = config
        self._clock = clock
        self.agent = agent
        self._peers = peers
        self._notify = notify  # PrefillNotifier.notify
        self._counters = counters
        # bound at registration (NixlWorkerSide.register_kv_caches)
        self._layout: KVLayout | None = None
        self._shard: RankLayout | None = None  # the heads this rank holds
        self._geometry: BlockGeometry | None = None
        self._warned_slices = False
        self.ledger = ReadLedger(counters)  # parts over, requests received, figures
        self._loads: dict[tuple[str, int], _Load] = {}  # parts in flight, by (request, P rank)
        # ended parts whose READ may still land: blocks held, request not reported
        self._quarantine: dict[tuple[str, int], _Load] = {}
        # handles NIXL refused to free after their peer's agent was removed
        # (nothing can land any more); release retried, no blocks tied to them
        self._zombies: list[Any] = []
        self._read_faults = ReadFaults()  # test hook (kvtransfer/fault_injection.py)

    def bind(self, layout: KVLayout, shard: RankLayout, geometry: BlockGeometry) -> None:
        self._layout, self._shard, self._geometry = layout, shard, geometry

    def in_flight(self) -> int:
        return len(self._loads)

    def quarantined(self) -> int:
        return len(self._quarantine)

    def leftovers(self) -> dict[str, list]:
        """What an idle engine must not hold (``check_integrity``)."""
        queued = [
            item.spec.request_id
            for peer in self._peers.peers_with_waiting()
            for item in peer.waiting
            if isinstance(item, _Load)
        ]
        return {
            "loads in flight": sorted(self._loads),
            "loads waiting for a handshake": sorted(queued),
            "loads quarantined (a READ may still land)": sorted(self._quarantine),
            "loads with parts not over": sorted(self.ledger.pending),
        }

    def release_all(self) -> None:
        for load in [*self._loads.values(), *self._quarantine.values()]:
            if load.handle is not None:
                self.agent.release(load.handle)
        self._loads.clear()
        self._quarantine.clear()

    def start_load(self, spec: LoadSpec) -> None:
        deadline_mono = self._clock() + self.config.load_timeout_s
        if spec.error or self._layout is None:
            self._fail(
                _Load(spec, deadline_mono), spec.error or "the local KV cache is not registered"
            )
            return
        if not spec.local_block_ids:  # nothing to read; P is told "done" at once
            self.ledger.done_recving.add(spec.request_id)
            self._notify(spec.peer, NOTIF_DONE, spec.remote_request_id, rank_done=True)
            return
        try:
            reads = plan_rank_reads(
                self._layout.num_kv_heads,
                spec.peer.tp_size,
                self.config.tp_size,
                self.config.tp_rank,
            )
        except ValueError as e:
            self._fail(_Load(spec, deadline_mono), f"no read plan for the prefill engine: {e}")
            return
        self.ledger.plan(spec.request_id, len(reads))
        for read in reads:
            load = _Load(spec, deadline_mono, read)
            peer, error = self._lookup(spec.peer, read.src_rank)
            if peer is None:
                self._fail(load, error)
                continue
            load.peer = peer
            if peer.ready:
                self._issue(load)
            else:
                peer.waiting.append(load)

    def start_notify(self, notify: NotifySpec) -> None:
        if self.config.notification_transport == "side_channel":
            self._notify(notify.peer, notify.kind, notify.remote_request_id)
            return
        peer, _ = self._lookup(notify.peer, 0)  # NIXL notifications need the lead's agent
        if peer is None:
            return
        if peer.ready:
            self._notify(peer.addr, notify.kind, notify.remote_request_id)
        else:
            peer.waiting.append(notify)

    def _lookup(self, addr: PeerAddr, rank: int) -> tuple[Peer | None, str]:
        """Rank ``rank`` of the prefill engine at ``addr``, or ``(None, why)``
        (a stale epoch). Older incarnations' work fails here."""
        peer, dropped, error = self._peers.lookup(addr, rank)
        for old in dropped:
            self._fail_peer_work(old, f"prefill engine {old.addr.engine_id} restarted")
        return peer, error

    def _issue(self, load: _Load) -> None:
        spec, peer = load.spec, load.peer
        assert peer is not None and peer.region is not None and peer.shard is not None
        assert self.agent.region is not None and self._geometry is not None
        assert self._shard is not None and load.read is not None
        if self._clock() >= spec.lease_deadline_mono:
            self._fail(load, "the prefill engine's lease expired before the read started")
            return
        # "host": an exported prefix in the peer's host KV tier (kvtransfer/tiers/)
        host = spec.remote_medium == "host"
        remote = peer.host_region if host else peer.region
        if remote is None:
            self._fail(load, f"engine {peer.addr.engine_id} registered no host KV tier")
            return
        local_limit, remote_limit = self.agent.region.num_blocks, remote.num_blocks
        local_ids, remote_ids = spec.local_block_ids, spec.remote_block_ids  # both non-empty
        if not (0 <= min(local_ids) and max(local_ids) < local_limit) or not (
            0 <= min(remote_ids) and max(remote_ids) < remote_limit
        ):
            self._fail(load, f"block id out of range (local {local_limit}, remote {remote_limit})")
            return
        load.start_s = time.perf_counter()  # cma copies inside the post: time it too
        whole_blocks = load.read.num_heads == self._shard.num_heads == peer.shard.num_heads
        try:
            if whole_blocks and self.agent.uses_prepped_lists and not host:  # ids, no addresses
                load.handle, state, load.num_descriptors = self.agent.start_block_read(
                    peer.agent_name, peer.region, spec.local_block_ids, spec.remote_block_ids
                )
                load.num_bytes = len(spec.local_block_ids) * self.agent.region.block_len
            else:
                descs = read_descriptors(
                    self._geometry,
                    self._shard,
                    peer.shard,
                    load.read,
                    spec.local_block_ids,
                    spec.remote_block_ids,
                    self.agent.region.base_addr,
                    remote.base_addr,
                )
                load.handle, state = self.agent.start_read(peer.agent_name, remote, descs)
                load.num_descriptors, load.num_bytes = len(descs), descs.num_bytes
        except Exception as e:
            self._fail(load, f"posting the READ failed: {e!r}")
            self._peers.invalidate(peer)
            return
        if load.num_descriptors > len(spec.local_block_ids) and not self._warned_slices:
            self._warned_slices = True  # once: a head slice of blocks-first blocks
            logger.warning(
                "reading KV head slices in the %s layout: %d descriptors for %d blocks "
                "(--kv-layout head_major makes a head slice one descriptor per block)",
                self._layout.layout,
                load.num_descriptors,
                len(spec.local_block_ids),
            )
        self._loads[load.key] = load
        if state == "ERR":
            self._finish_load(load, "ERR")

    def poll_handshakes(self) -> None:
        ready, failed = self._peers.poll()
        for peer in ready:
            waiting, peer.waiting = peer.waiting, []
            for item in waiting:
                if isinstance(item, _Load):
                    self._issue(item)
                else:
                    self._notify(peer.addr, item.kind, item.remote_request_id)
        for peer, reason in failed:
            self._fail_peer_work(peer, reason)

    def poll_loads(self) -> None:
        now_mono = self._clock()
        for load in list(self._loads.values()):
            state = self.agent.check(load.handle)
            if state == "PROC" and (
                now_mono > load.deadline_mono or now_mono > load.spec.lease_deadline_mono
            ):
                state = "TIMEOUT"
            if state == "DONE" and self._read_faults.fail_this_read():
                self._counters["num_injected_read_failures"] += 1
                state = "ERR"
            if state != "PROC":
                self._finish_load(load, state)
        for peer in self._peers.peers_with_waiting():
            for item in list(peer.waiting):
                if isinstance(item, _Load) and now_mono > item.deadline_mono:
                    peer.waiting.remove(item)
                    self._fail(item, "timed out waiting for the handshake")
        self._zombies = [h for h in self._zombies if not self.agent.release(h)]

    def _finish_load(self, load: _Load, state: str) -> None:
        peer = load.peer
        del self._loads[load.key]
        if state != "DONE":
            reason = {"ERR": "the READ failed", "TIMEOUT": "the READ missed its deadline"}[state]
            if state == "ERR" and peer is not None:
                self._peers.invalidate(peer)
            self._end_failed(load, reason)
            return
        if not self.agent.release(load.handle):  # DONE: nothing more can land
            self._zombies.append(load.handle)
        self._part_over(load, failed=False)

    def _part_over(self, load: _Load, failed: bool) -> None:
        """One part of a request's load is over (done or failed, nothing can
        land any more). When it was the last: the request is received, its
        blocks in error if any part failed, and P's lead hears "done" from
        this rank."""
        spec = load.spec
        if self.ledger.part_over(spec, failed, load.num_bytes, load.num_descriptors, load.start_s):
            self._notify(spec.peer, NOTIF_DONE, spec.remote_request_id, rank_done=True)

    def _end_failed(self, load: _Load, reason: str) -> None:
        """A posted READ failed or was given up: report it once it cannot land."""
        if self._can_still_land(load):
            load.failure = reason
            self._quarantine[load.key] = load
            self._counters["num_quarantined_loads"] += 1
            logger.warning(
                "KV load of request %s failed (%s) but NIXL cannot cancel its READ yet: "
                "its blocks stay quarantined",
                load.spec.request_id,
                reason,
            )
            return
        self._fail(load, reason)

    def _can_still_land(self, load: _Load) -> bool:
        """Try to make the READ of ``load`` impossible: release (cancel) its
        handle, else remove the peer's agent. False once nothing can land."""
        if load.handle is None or self.agent.release(load.handle):
            load.handle = None
            return False
        peer = load.peer
        if peer is not None and not peer.agent_removed:
            self._peers.invalidate(peer)  # NIXL disconnects and drops its registration
            if peer.agent_removed:
                self._fail_peer_work(peer, f"prefill engine {peer.addr.engine_id} was dropped")
        if peer is None or peer.agent_removed:
            self._zombies.append(load.handle)
            load.handle = None
            return False
        return True

    def poll_quarantine(self) -> None:
        for key, load in list(self._quarantine.items()):
            if load.handle is not None and self.agent.check(load.handle) != "PROC":
                if self.agent.release(load.handle):
                    load.handle = None
            if load.handle is None or not self._can_still_land(load):
                del self._quarantine[key]
                self._fail(load, load.failure)

    def _fail(self, load: _Load, reason: str) -> None:
        """The part failed: once the request's last part is over it is reported
        with its local blocks in error and P is told to free (best effort:
        otherwise its lease frees them)."""
        spec = load.spec
        where = f" (prefill rank {load.read.src_rank})" if load.read is not None else ""
        logger.warning("KV load of request %s failed%s: %s", spec.request_id, where, reason)
        self._part_over(load, failed=True)

    def _fail_peer_work(self, peer: Peer, reason: str) -> None:
        """The peer is gone or never came: fail its queued and in-flight loads."""
        waiting, peer.waiting = peer.waiting, []
        for item in waiting:
            if isinstance(item, _Load):
                item.peer = None
                self._fail(item, reason)
        for load in [ld for ld in self._loads.values() if ld.peer is peer]:
            del self._loads[load.key]
            self._end_failed(load, reason)
