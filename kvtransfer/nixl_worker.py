"""Worker side of the NIXL connector: the KV bytes move here.

Decode role, per LoadSpec (this worker is rank d of a decode engine with
tensor-parallel size D; P has size len(peer.rank_ports) or 1)::

    start_load_kv: read plan (tp_plan.plan_rank_reads): one PART per prefill
                   rank whose heads rank d needs (homogeneous TP: rank d only)
                   each part: peer rank ready? -> post its READ (descriptors:
                   tp_plan.read_descriptors); handshake pending? -> queue (never blocks)
    get_finished:  handshakes done -> post queued READs
                   a part DONE / ERR / peer gone / deadline / lease -> part over
                   every part over -> done_recving (+ load-error blocks if any part
                   failed), "done" (rank d of D) to P's lead rank, best effort

Prefill role, per SendSpec, on the lead rank (0) only: hold until "done"
from every decode rank (a notification names its rank of how many) ->
done_sending, or until the lease deadline (extended by "renew") ->
done_sending. Other prefill ranks only serve their shard (handshake + NIXL).

Quarantine: a load that ends (deadline, peer gone, error) while NIXL
refuses to release its handle could still be written by a late READ. Its
request is not reported (so the scheduler neither frees, reuses, recomputes
into nor hashes its blocks) until the READ can no longer land::

    end of load -> release(handle) ok ------------------------> report
                   refused -> quarantine -> each poll: handle DONE/ERR and
                              released, or the peer's agent removed
                              (remove_remote_agent: NIXL drops the
                              connection and the remote's registration) -> report

Deadlines and leases are on this process's monotonic clock (``clock``).

Notifications go over the ZMQ side channel by default (see side_channel.py
for why), or as NIXL notifications; P accepts both.

A load's deadline is ``min(start + load_timeout_s, lease_deadline)``: past
the lease P may reuse the blocks, so a late read is a failed read.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

import zmq

from tandem.kvtransfer.base import KVConnectorWorkerSide
from tandem.kvtransfer.compat import STORAGE_ORDER, KVLayout, RankLayout, compat_hash
from tandem.kvtransfer.config import KVTransferConfig
from tandem.kvtransfer.fault_injection import ReadFaults
from tandem.kvtransfer.nixl_agent import NixlAgent, make_agent_name
from tandem.kvtransfer.nixl_meta import (
    NOTIF_DONE,
    NOTIF_RENEW,
    LoadSpec,
    NixlConnectorMetadata,
    NotifKey,
    NotifySpec,
    PeerAddr,
    decode_notif,
    encode_notif,
)
from tandem.kvtransfer.nixl_peers import Peer, PeerTable
from tandem.kvtransfer.progress_poller import ProgressPoller
from tandem.kvtransfer.side_channel import (
    HandshakeInfo,
    Notification,
    NotificationSender,
    RegionInfo,
    SideChannelServer,
)
from tandem.kvtransfer.tp_plan import (
    BlockGeometry,
    HeadRead,
    plan_rank_reads,
    read_descriptors,
    shard_for,
)
from tandem.kvtransfer.ucx.env import apply_ucx_env
from tandem.kvtransfer.ucx.probe import TransportProbe
from tandem.kvtransfer.ucx.proto_info import TransportReport
from tandem.wire.auth import PlaneAuth
from tandem.wire.frames import FrameCounters

logger = logging.getLogger(__name__)

_MAX_RECENT_TRANSFERS = 4096


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


@dataclasses.dataclass
class _Pending:
    """A request's load on this rank until its last part is over."""

    num_parts_left: int
    failed: bool = False
    num_bytes: int = 0
    num_descriptors: int = 0
    start_s: float = float("inf")
    end_s: float = 0.0


@dataclasses.dataclass
class _Send:
    num_blocks: int
    lease_deadline_mono: float


class NixlWorkerSide(KVConnectorWorkerSide):
    # the msgspec type of this connector's per-step metadata (crosses to TP
    # worker processes as plain data)
    metadata_type = NixlConnectorMetadata

    def __init__(
        self, config: KVTransferConfig, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.config = config
        self._clock = clock
        apply_ucx_env(config.device)  # before the agent makes its UCX context
        self._transport_probe: TransportProbe | None = None
        self.agent = NixlAgent(
            make_agent_name(config.engine_id, config.epoch),
            config.backends,
            progress_thread=config.nixl_progress_thread,
            prepped_reads=config.nixl_prepped_reads and config.pulls_kv,
        )
        self._server: SideChannelServer | None = None
        if config.serves_kv:
            self._server = SideChannelServer(
                config.engine_id,
                config.epoch,
                config.side_channel_host,
                config.side_channel_port,
                secret=config.cluster_secret,
            )
        self._zmq = zmq.Context()
        # client side only (no ZAP thread): handshakes and notifications to P
        self._auth = PlaneAuth(self._zmq, config.cluster_secret)
        self.malformed_frames = FrameCounters()
        self._notifier = NotificationSender(self._zmq, self._auth)
        self._peers = PeerTable(
            self.agent,
            self._zmq,
            config.engine_id,
            config.handshake_timeout_s,
            auth=self._auth,
            malformed=self.malformed_frames,
        )
        self._layout: KVLayout | None = None
        self._shard: RankLayout | None = None  # the heads this rank holds
        self._warned_slices = False
        self._geometry: BlockGeometry | None = None
        self._pending: dict[str, _Pending] = {}  # request id -> its parts not over yet
        self._loads: dict[tuple[str, int], _Load] = {}  # parts in flight, by (request, P rank)
        # ended parts whose READ may still land: blocks held, request not reported
        self._quarantine: dict[tuple[str, int], _Load] = {}
        # handles NIXL refused to free after their peer's agent was removed
        # (nothing can land any more); release retried, no blocks tied to them
        self._zombies: list[Any] = []
        self._sends: dict[str, _Send] = {}
        self._early_done: dict[str, float] = {}  # "done" before the SendSpec arrived
        # decode ranks that said "done" so far, per request (and when the first did)
        self._done_ranks: dict[str, tuple[set[int], float]] = {}
        self._done_sending: set[str] = set()
        self._done_recving: set[str] = set()
        self._error_block_ids: set[int] = set()
        self._counters: dict[str, float] = collections.defaultdict(float)
        # (request id, blocks, bytes, descriptors, READ posted, READ done; perf_counter)
        # of completed READs, for the
        # engine's per-request timings (drain_load_records)
        self._load_records: collections.deque[tuple[str, int, int, int, float, float]] = (
            collections.deque(maxlen=_MAX_RECENT_TRANSFERS)
        )
        self._recent_transfer_s: collections.deque[float] = collections.deque(
            maxlen=_MAX_RECENT_TRANSFERS
        )
        self._closed = False
        self._read_faults = ReadFaults()  # test hook (kvtransfer/fault_injection.py)
        # serves peers' READs while the loop is busy (progress_poller.py)
        self._poller: ProgressPoller | None = None
        if (
            config.serves_kv
            and not config.nixl_progress_thread
            and config.nixl_progress_poll_interval_s > 0
        ):
            self._poller = ProgressPoller(
                self.agent.progress,
                lambda: bool(self._sends),
                config.nixl_progress_poll_interval_s,
            )

    def transport_report(self) -> TransportReport | None:
        """What UCX picked for READs into this cache (``ucx/probe.py``); None
        while the probe runs or when it is off."""
        return self._transport_probe.report() if self._transport_probe else None

    def wire_stats(self) -> dict[str, dict[str, int]]:
        """Malformed messages and refused handshakes per socket name
        (``kv_side_channel`` on P, ``kv_handshake_reply`` on D)."""
        malformed = self.malformed_frames.snapshot()
        auth: dict[str, int] = {}
        if self._server is not None:
            malformed.update(self._server.malformed_frames.snapshot())
            auth.update(self._server.auth.failures())
        return {"malformed_frames": malformed, "auth_failures": auth}

    def ready_peer(
        self, engine_id: str, epoch: int, rank: int = 0
    ) -> tuple[str, RegionInfo] | None:
        """``(agent name, registered region)`` of rank ``rank`` of a prefill
        engine incarnation this worker finished a handshake with, else None.
        For benchmarks that post raw READs through ``self.agent``."""
        peer = self._peers.find(PeerAddr(engine_id, epoch, "", 0), rank)  # keyed by id + epoch
        if peer is None or not peer.ready or peer.region is None:
            return None
        return peer.agent_name, peer.region

    @property
    def side_channel_port(self) -> int | None:
        return self._server.port if self._server is not None else None

    @property
    def layout(self) -> KVLayout | None:
        return self._layout

    @property
    def shard(self) -> RankLayout | None:
        return self._shard

    # ---- registration -----------------------------------------------------------

    def register_kv_caches(self, kv_cache: Any) -> None:
        """Register this rank's shard: the logical ``[blk, L, 2, bs, heads held,
        d]`` tensor in ``config.kv_layout`` (``workers/runner/kv_cache.py``)."""
        self._layout, self._shard = self._check_layout(kv_cache)
        storage = kv_cache.permute(*STORAGE_ORDER[self._layout.layout])
        if not storage.is_contiguous() or kv_cache.storage_offset() != 0:
            raise ValueError(f"the KV cache tensor is not a whole {self._layout.layout} cache")
        lay = self._layout
        self._geometry = BlockGeometry(
            lay.layout, lay.num_layers, lay.block_size, lay.head_dim, kv_cache.element_size()
        )
        region = self.agent.register(storage)
        if self.config.runs_transport_probe and self._transport_probe is None:
            self._transport_probe = TransportProbe(
                region.mem_type, region.device_id, self.config.engine_id
            )
        self._peers.set_local_layout(self._layout, self._geometry.head_block_bytes)
        if self._server is not None:
            self._server.set_info(
                HandshakeInfo(
                    engine_id=self.config.engine_id,
                    epoch=self.config.epoch,
                    agent_name=self.agent.name,
                    agent_metadata=self.agent.metadata,
                    compat_hash=compat_hash(self._layout),
                    layout=self._layout,
                    region=region,
                    rank=self._shard,
                )
            )

    def _check_layout(self, kv_cache: Any) -> tuple[KVLayout, RankLayout]:
        cfg = self.config
        if kv_cache.dim() != 6 or kv_cache.shape[2] != 2:
            raise ValueError(
                "KV cache must be [num_blocks, num_layers, 2, block_size, num_kv_heads, "
                f"head_dim], got shape {tuple(kv_cache.shape)}"
            )
        _, num_layers, _, block_size, num_local_heads, head_dim = kv_cache.shape
        dtype = str(kv_cache.dtype).removeprefix("torch.")
        actual = {
            "block_size": block_size,
            "num_layers": num_layers,
            "head_dim": head_dim,
            "kv_dtype": dtype,
        }
        for name, value in actual.items():
            expected = getattr(cfg, name)
            if expected is not None and expected != value:
                raise ValueError(
                    f"KV cache {name}={value!r} but KVTransferConfig says {expected!r}"
                )
        num_kv_heads = cfg.num_kv_heads if cfg.num_kv_heads is not None else num_local_heads
        shard = shard_for(num_kv_heads, cfg.tp_size, cfg.tp_rank)
        if shard.num_heads != num_local_heads:
            raise ValueError(
                f"KV cache holds {num_local_heads} KV heads but rank {cfg.tp_rank} of "
                f"{cfg.tp_size} holds {shard.num_heads} of the model's {num_kv_heads} "
                "(KVTransferConfig.num_kv_heads)"
            )
        layout = KVLayout(
            cfg.model_name, dtype, num_layers, num_kv_heads, head_dim, block_size, cfg.kv_layout
        )
        return layout, shard

    # ---- per step ---------------------------------------------------------------

    def start_load_kv(self, metadata: NixlConnectorMetadata | None) -> None:
        if metadata is None or self._closed:
            return
        # Every prefill rank tracks the sends (the progress poller runs while any
        # is held: a decode rank's connection needs this rank's UCX progress);
        # only the lead answers for them (done_sending) and hears D's "done".
        # Other ranks drop a send when the engine freed it (finished_sends),
        # it was cancelled, or its lease ended.
        lead = self.config.is_lead_rank
        for send in metadata.new_sends:
            if lead and self._early_done.pop(send.request_id, None) is not None:
                self._done_sending.add(send.request_id)
            else:
                self._sends[send.request_id] = _Send(send.num_blocks, send.lease_deadline_mono)
                if self._poller is not None:
                    self._poller.wake()
        dropped = (
            metadata.cancelled_sends if lead else metadata.cancelled_sends + metadata.finished_sends
        )
        for request_id in dropped:
            self._sends.pop(request_id, None)
            self._done_ranks.pop(request_id, None)
        for spec in metadata.loads:
            self._start_load(spec)
        for notify in metadata.notifies if lead else ():
            self._start_notify(notify)

    def get_finished(self) -> tuple[set[str], set[str]]:
        if not self._closed:
            self._poll_handshakes()
            self._poll_loads()
            self._poll_quarantine()
            if self.config.serves_kv:
                if self.config.is_lead_rank:
                    self._poll_notifs()
                else:  # receives nothing, but a decode rank's connection needs UCX progress
                    self.agent.get_notifs()
                self._expire_leases()
            elif self.config.notification_transport == "nixl":
                self.agent.get_notifs()  # progress UCX so queued notifications go out
        done_sending, self._done_sending = self._done_sending, set()
        done_recving, self._done_recving = self._done_recving, set()
        return done_sending, done_recving

    def get_block_ids_with_load_errors(self) -> set[int]:
        block_ids, self._error_block_ids = self._error_block_ids, set()
        return block_ids

    # ---- decode side ------------------------------------------------------------

    def _start_load(self, spec: LoadSpec) -> None:
        deadline_mono = self._clock() + self.config.load_timeout_s
        if spec.error or self._layout is None:
            self._fail(
                _Load(spec, deadline_mono), spec.error or "the local KV cache is not registered"
            )
            return
        if not spec.local_block_ids:  # nothing to read; P is told "done" at once
            self._done_recving.add(spec.request_id)
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
        self._pending[spec.request_id] = _Pending(len(reads))
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

    def _start_notify(self, notify: NotifySpec) -> None:
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
        local_limit, remote_limit = self.agent.region.num_blocks, peer.region.num_blocks
        local_ids, remote_ids = spec.local_block_ids, spec.remote_block_ids  # both non-empty
        if not (0 <= min(local_ids) and max(local_ids) < local_limit) or not (
            0 <= min(remote_ids) and max(remote_ids) < remote_limit
        ):
            self._fail(load, f"block id out of range (local {local_limit}, remote {remote_limit})")
            return
        load.start_s = time.perf_counter()  # cma copies inside the post: time it too
        whole_blocks = load.read.num_heads == self._shard.num_heads == peer.shard.num_heads
        try:
            if whole_blocks and self.agent.uses_prepped_lists:  # block ids, no addresses
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
                    peer.region.base_addr,
                )
                load.handle, state = self.agent.start_read(peer.agent_name, peer.region, descs)
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

    def _poll_handshakes(self) -> None:
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

    def _poll_loads(self) -> None:
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
        pending = self._pending.get(spec.request_id)
        if pending is None:  # failed before it was planned: one part
            pending = _Pending(1)
        pending.num_parts_left -= 1
        pending.failed |= failed
        if not failed:
            pending.num_bytes += load.num_bytes
            pending.num_descriptors += load.num_descriptors
            pending.start_s = min(pending.start_s, load.start_s)
            pending.end_s = max(pending.end_s, time.perf_counter())
        if pending.num_parts_left > 0:
            return
        self._pending.pop(spec.request_id, None)
        self._done_recving.add(spec.request_id)
        if pending.failed:
            self._counters["num_failures"] += 1
            self._error_block_ids.update(spec.local_block_ids)
        else:
            seconds = pending.end_s - pending.start_s
            self._counters["kv_transfer_bytes_total"] += pending.num_bytes
            self._counters["kv_transfer_seconds_total"] += seconds
            self._counters["num_transfers"] += 1
            self._counters["num_descriptors"] += pending.num_descriptors
            self._counters["last_transfer_s"] = seconds
            self._recent_transfer_s.append(seconds)
            self._load_records.append(
                (
                    spec.request_id,
                    len(spec.local_block_ids),
                    pending.num_bytes,
                    pending.num_descriptors,
                    pending.start_s,
                    pending.end_s,
                )
            )
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

    def _poll_quarantine(self) -> None:
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

    def _notify(
        self, addr: PeerAddr, kind: str, remote_request_id: str, rank_done: bool = False
    ) -> None:
        """Tell P's lead rank ``kind`` about its request; never blocks, failures
        are counted (P's lease still frees the blocks). ``rank_done``: this
        rank's reads are over, P waits for every decode rank's; else the
        message speaks for the whole engine."""
        ok = False
        if not addr.host:  # P was never registered: there is nobody to tell
            return
        rank, num_ranks = (self.config.tp_rank, self.config.tp_size) if rank_done else (0, 1)
        lead = self._peers.find(addr, 0) if self.config.notification_transport == "nixl" else None
        if lead is None or not lead.ready:  # the side channel, or no NIXL peer to use
            message = Notification(
                addr.engine_id, addr.epoch, kind, remote_request_id, rank, num_ranks
            )
            ok = self._notifier.send(addr.host, addr.port, message)
        else:
            try:
                message = encode_notif(kind, remote_request_id, rank, num_ranks)
                self.agent.send_notif(lead.agent_name, message)
                ok = True
            except Exception as e:
                logger.warning("NIXL notification to %s failed: %r", addr.engine_id, e)
        if ok:
            self._counters["num_notifs_sent"] += 1
        else:
            self._counters["num_notif_failures"] += 1

    # ---- prefill side -----------------------------------------------------------

    def _received_notifs(self) -> list[NotifKey]:
        """Notifications from the side channel and from NIXL. Calling
        get_new_notifs also progresses UCX, which two-sided transports need."""
        received = self._server.drain_notifications() if self._server is not None else []
        for messages in self.agent.get_notifs().values():
            for message in messages:
                decoded = decode_notif(message)
                if decoded is None:
                    logger.warning("ignoring unknown notification %r", message[:64])
                else:
                    received.append(decoded)
        return received

    def _poll_notifs(self) -> None:
        now = self._clock()
        for note in self._received_notifs():
            request_id = note.request_id
            send = self._sends.get(request_id)
            if note.kind == NOTIF_RENEW:
                if send is not None:
                    send.lease_deadline_mono = max(
                        send.lease_deadline_mono, now + self.config.lease_s
                    )
                    self._counters["num_lease_renewals"] += 1
                continue
            if note.num_ranks > 1:  # one decode rank of several: wait for all of them
                ranks, first_s = self._done_ranks.setdefault(request_id, (set(), now))
                ranks.add(note.rank)
                if len(ranks) < note.num_ranks:
                    continue
                del self._done_ranks[request_id]
            if send is not None:
                del self._sends[request_id]
                self._done_sending.add(request_id)
            else:
                self._early_done[request_id] = now

    def _expire_leases(self) -> None:
        now = self._clock()
        for request_id, send in list(self._sends.items()):
            if now >= send.lease_deadline_mono:
                del self._sends[request_id]
                self._done_ranks.pop(request_id, None)
                if not self.config.is_lead_rank:
                    continue  # the lead frees the engine's blocks
                self._done_sending.add(request_id)
                self._counters["num_lease_expiries"] += 1
                logger.info("lease of request %s expired: freeing its blocks", request_id)
        stale = [r for r, t in self._early_done.items() if now - t > self.config.lease_s]
        for request_id in stale:
            del self._early_done[request_id]
        stale = [r for r, (_, t) in self._done_ranks.items() if now - t > self.config.lease_s]
        for request_id in stale:
            del self._done_ranks[request_id]

    # ---- observability / lifecycle ----------------------------------------------

    def stats(self) -> dict[str, float]:
        out = {
            name: self._counters.get(name, 0.0)
            for name in (
                "kv_transfer_bytes_total",
                "kv_transfer_seconds_total",
                "num_transfers",
                "num_descriptors",
                "num_failures",
                "last_transfer_s",
                "num_notifs_sent",
                "num_notif_failures",
                "num_lease_renewals",
                "num_lease_expiries",
            )
        }
        out["num_blocks_held_for_transfer"] = float(sum(s.num_blocks for s in self._sends.values()))
        out["num_loads_in_flight"] = float(len(self._loads))
        out["num_loads_quarantined"] = float(len(self._quarantine))
        out["num_quarantined_loads_total"] = self._counters.get("num_quarantined_loads", 0.0)
        out["num_handshakes"] = float(self._peers.num_handshakes)
        out["num_handshake_failures"] = float(self._peers.num_handshake_failures)
        out["num_injected_read_failures"] = self._counters.get("num_injected_read_failures", 0.0)
        out["num_progress_polls"] = float(self._poller.num_progress_calls if self._poller else 0)
        return out

    def drain_load_records(self) -> list[tuple[str, int, int, int, float, float]]:
        """``(request_id, num_blocks, num_bytes, num_descriptors, start_s, end_s)``
        (``time.perf_counter``) of every READ
        completed since the last call (engine loop thread, after each step)."""
        out = list(self._load_records)
        self._load_records.clear()
        return out

    def drain_transfer_seconds(self) -> list[float]:
        """Per-transfer seconds since the last call (for a histogram)."""
        out = list(self._recent_transfer_s)
        self._recent_transfer_s.clear()
        return out

    def check_integrity(self) -> None:
        """Idle engine: no load in flight or queued, no send held."""
        queued = [
            item.spec.request_id
            for peer in self._peers.peers_with_waiting()
            for item in peer.waiting
            if isinstance(item, _Load)
        ]
        leftovers = {
            "loads in flight": sorted(self._loads),
            "loads waiting for a handshake": sorted(queued),
            "loads quarantined (a READ may still land)": sorted(self._quarantine),
            "loads with parts not over": sorted(self._pending),
            "sends held": sorted(self._sends),
        }
        leftovers = {k: v for k, v in leftovers.items() if v}
        if leftovers:
            raise AssertionError(f"NixlWorkerSide not idle: {leftovers}")

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._poller is not None:
            self._poller.close()
        for load in [*self._loads.values(), *self._quarantine.values()]:
            if load.handle is not None:
                self.agent.release(load.handle)
        self._loads.clear()
        self._quarantine.clear()
        handshakes_idle = self._peers.close()
        self._notifier.close()
        if self._server is not None:
            self._server.close()
        if handshakes_idle:  # else a handshake thread may still hold a socket
            self._zmq.term()
        self.agent.close()
