"""Worker side of the NIXL connector: the KV bytes move here.

Decode role, per LoadSpec::

    start_load_kv: peer ready? -> post READ (one descriptor per block run)
                   handshake pending? -> queue on the peer (never blocks)
    get_finished:  handshakes done -> post queued READs
                   READ DONE -> notify P "done" (its request id) -> done_recving
                   ERR / peer gone / deadline / lease -> done_recving + load-error blocks,
                   best-effort "done" to P, peer forgotten (re-handshake next time)

Prefill role, per SendSpec: hold until "done" from D -> done_sending, or
until the lease deadline (extended by "renew") -> done_sending.

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

from kvtransfer.base import KVConnectorWorkerSide
from kvtransfer.compat import KVLayout, compat_hash
from kvtransfer.config import KVTransferConfig
from kvtransfer.fault_injection import ReadFaults
from kvtransfer.nixl_agent import NixlAgent, make_agent_name, split_block_runs
from kvtransfer.nixl_meta import (
    NOTIF_DONE,
    NOTIF_RENEW,
    LoadSpec,
    NixlConnectorMetadata,
    NotifySpec,
    PeerAddr,
    decode_notif,
    encode_notif,
)
from kvtransfer.nixl_peers import Peer, PeerTable
from kvtransfer.progress_poller import ProgressPoller
from kvtransfer.side_channel import (
    HandshakeInfo,
    Notification,
    NotificationSender,
    SideChannelServer,
)
from wire.auth import PlaneAuth
from wire.frames import FrameCounters

logger = logging.getLogger(__name__)

_MAX_RECENT_TRANSFERS = 4096


@dataclasses.dataclass
class _Load:
    spec: LoadSpec
    deadline_mono: float
    peer: Peer | None = None
    handle: Any = None
    start_s: float = 0.0
    num_bytes: int = 0
    num_descriptors: int = 0
    failure: str = ""  # why it failed ("" = the READ completed)


@dataclasses.dataclass
class _Send:
    num_blocks: int
    lease_deadline_mono: float


class NixlWorkerSide(KVConnectorWorkerSide):
    def __init__(
        self, config: KVTransferConfig, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.config = config
        self._clock = clock
        self.agent = NixlAgent(
            make_agent_name(config.engine_id, config.epoch),
            config.backends,
            progress_thread=config.nixl_progress_thread,
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
        self._loads: dict[str, _Load] = {}  # in flight
        # ended loads whose READ may still land: blocks held, request not reported
        self._quarantine: dict[str, _Load] = {}
        # handles NIXL refused to free after their peer's agent was removed
        # (nothing can land any more); release retried, no blocks tied to them
        self._zombies: list[Any] = []
        self._sends: dict[str, _Send] = {}
        self._early_done: dict[str, float] = {}  # "done" before the SendSpec arrived
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

    def wire_stats(self) -> dict[str, dict[str, int]]:
        """Malformed messages and refused handshakes per socket name
        (``kv_side_channel`` on P, ``kv_handshake_reply`` on D)."""
        malformed = self.malformed_frames.snapshot()
        auth: dict[str, int] = {}
        if self._server is not None:
            malformed.update(self._server.malformed_frames.snapshot())
            auth.update(self._server.auth.failures())
        return {"malformed_frames": malformed, "auth_failures": auth}

    @property
    def side_channel_port(self) -> int | None:
        return self._server.port if self._server is not None else None

    @property
    def layout(self) -> KVLayout | None:
        return self._layout

    # ---- registration -----------------------------------------------------------

    def register_kv_caches(self, kv_cache: Any) -> None:
        self._layout = self._check_layout(kv_cache)
        region = self.agent.register(kv_cache)
        self._peers.set_local_layout(self._layout, region.block_len)
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
                )
            )

    def _check_layout(self, kv_cache: Any) -> KVLayout:
        cfg = self.config
        if kv_cache.dim() != 6 or kv_cache.shape[2] != 2:
            raise ValueError(
                "KV cache must be [num_blocks, num_layers, 2, block_size, num_kv_heads, "
                f"head_dim], got shape {tuple(kv_cache.shape)}"
            )
        _, num_layers, _, block_size, num_kv_heads, head_dim = kv_cache.shape
        dtype = str(kv_cache.dtype).removeprefix("torch.")
        actual = {
            "block_size": block_size,
            "num_layers": num_layers,
            "num_kv_heads": num_kv_heads,
            "head_dim": head_dim,
            "kv_dtype": dtype,
        }
        for name, value in actual.items():
            expected = getattr(cfg, name)
            if expected is not None and expected != value:
                raise ValueError(
                    f"KV cache {name}={value!r} but KVTransferConfig says {expected!r}"
                )
        return KVLayout(cfg.model_name, dtype, num_layers, num_kv_heads, head_dim, block_size)

    # ---- per step ---------------------------------------------------------------

    def start_load_kv(self, metadata: NixlConnectorMetadata | None) -> None:
        if metadata is None or self._closed:
            return
        for send in metadata.new_sends:
            if self._early_done.pop(send.request_id, None) is not None:
                self._done_sending.add(send.request_id)
            else:
                self._sends[send.request_id] = _Send(send.num_blocks, send.lease_deadline_mono)
                if self._poller is not None:
                    self._poller.wake()
        for request_id in metadata.cancelled_sends:
            self._sends.pop(request_id, None)
        for spec in metadata.loads:
            self._start_load(spec)
        for notify in metadata.notifies:
            self._start_notify(notify)

    def get_finished(self) -> tuple[set[str], set[str]]:
        if not self._closed:
            self._poll_handshakes()
            self._poll_loads()
            self._poll_quarantine()
            if self.config.serves_kv:
                self._poll_notifs()
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
        load = _Load(spec, self._clock() + self.config.load_timeout_s)
        if spec.error or self._layout is None:
            self._fail(load, spec.error or "the local KV cache is not registered")
            return
        if not spec.local_block_ids:  # nothing to read; P is told "done" at once
            self._done_recving.add(spec.request_id)
            self._notify(spec.peer, NOTIF_DONE, spec.remote_request_id)
            return
        peer = self._lookup(spec)
        if peer is None:
            return
        load.peer = peer
        if peer.ready:
            self._issue(load)
        else:
            peer.waiting.append(load)

    def _start_notify(self, notify: NotifySpec) -> None:
        if self.config.notification_transport == "side_channel":
            self._notify(notify.peer, notify.kind, notify.remote_request_id)
            return
        peer = self._lookup(notify)  # NIXL notifications need the peer's agent
        if peer is None:
            return
        if peer.ready:
            self._notify(peer.addr, notify.kind, notify.remote_request_id, peer)
        else:
            peer.waiting.append(notify)

    def _lookup(self, spec: LoadSpec | NotifySpec) -> Peer | None:
        peer, dropped, error = self._peers.lookup(spec.peer)
        for old in dropped:
            self._fail_peer_work(old, f"prefill engine {old.addr.engine_id} restarted")
        if peer is None and isinstance(spec, LoadSpec):
            self._fail(_Load(spec, 0.0), error)
        return peer

    def _issue(self, load: _Load) -> None:
        spec, peer = load.spec, load.peer
        assert peer is not None and peer.region is not None and self.agent.region is not None
        if self._clock() >= spec.lease_deadline_mono:
            self._fail(load, "the prefill engine's lease expired before the read started")
            return
        local_limit, remote_limit = self.agent.region.num_blocks, peer.region.num_blocks
        if any(not 0 <= b < local_limit for b in spec.local_block_ids) or any(
            not 0 <= b < remote_limit for b in spec.remote_block_ids
        ):
            self._fail(load, f"block id out of range (local {local_limit}, remote {remote_limit})")
            return
        load.start_s = time.perf_counter()  # cma copies inside the post: time it too
        try:
            runs = split_block_runs(spec.local_block_ids, spec.remote_block_ids)
            load.handle, state = self.agent.start_read(peer.agent_name, peer.region, runs)
        except Exception as e:
            self._fail(load, f"posting the READ failed: {e!r}")
            self._peers.invalidate(peer)
            return
        load.num_descriptors = len(runs)
        load.num_bytes = len(spec.local_block_ids) * self.agent.region.block_len
        self._loads[spec.request_id] = load
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
                    self._notify(peer.addr, item.kind, item.remote_request_id, peer)
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
        spec, peer = load.spec, load.peer
        del self._loads[spec.request_id]
        if state != "DONE":
            reason = {"ERR": "the READ failed", "TIMEOUT": "the READ missed its deadline"}[state]
            if state == "ERR" and peer is not None:
                self._peers.invalidate(peer)
            self._end_failed(load, reason)
            return
        if not self.agent.release(load.handle):  # DONE: nothing more can land
            self._zombies.append(load.handle)
        seconds = time.perf_counter() - load.start_s
        self._counters["kv_transfer_bytes_total"] += load.num_bytes
        self._counters["kv_transfer_seconds_total"] += seconds
        self._counters["num_transfers"] += 1
        self._counters["num_descriptors"] += load.num_descriptors
        self._counters["last_transfer_s"] = seconds
        self._recent_transfer_s.append(seconds)
        self._load_records.append(
            (
                spec.request_id,
                len(spec.local_block_ids),
                load.num_bytes,
                load.num_descriptors,
                load.start_s,
                load.start_s + seconds,
            )
        )
        self._done_recving.add(spec.request_id)
        self._notify(spec.peer, NOTIF_DONE, spec.remote_request_id, peer)

    def _end_failed(self, load: _Load, reason: str) -> None:
        """A posted READ failed or was given up: report it once it cannot land."""
        if self._can_still_land(load):
            load.failure = reason
            self._quarantine[load.spec.request_id] = load
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
        for request_id, load in list(self._quarantine.items()):
            if load.handle is not None and self.agent.check(load.handle) != "PROC":
                if self.agent.release(load.handle):
                    load.handle = None
            if load.handle is None or not self._can_still_land(load):
                del self._quarantine[request_id]
                self._fail(load, load.failure)

    def _fail(self, load: _Load, reason: str) -> None:
        """Report the load finished with its local blocks in error, and tell P
        to free (best effort: otherwise its lease frees them)."""
        spec = load.spec
        logger.warning("KV load of request %s failed: %s", spec.request_id, reason)
        self._counters["num_failures"] += 1
        self._done_recving.add(spec.request_id)
        self._error_block_ids.update(spec.local_block_ids)
        self._notify(spec.peer, NOTIF_DONE, spec.remote_request_id, load.peer)

    def _fail_peer_work(self, peer: Peer, reason: str) -> None:
        """The peer is gone or never came: fail its queued and in-flight loads."""
        waiting, peer.waiting = peer.waiting, []
        for item in waiting:
            if isinstance(item, _Load):
                item.peer = None
                self._fail(item, reason)
        for load in [ld for ld in self._loads.values() if ld.peer is peer]:
            del self._loads[load.spec.request_id]
            self._end_failed(load, reason)

    def _notify(
        self, addr: PeerAddr, kind: str, remote_request_id: str, peer: Peer | None = None
    ) -> None:
        """Tell P ``kind`` about its request; never blocks, failures are counted
        (P's lease still frees the blocks)."""
        ok = False
        if not addr.host:  # P was never registered: there is nobody to tell
            return
        if self.config.notification_transport == "side_channel":
            message = Notification(addr.engine_id, addr.epoch, kind, remote_request_id)
            ok = self._notifier.send(addr.host, addr.port, message)
        elif peer is not None and peer.ready:
            try:
                self.agent.send_notif(peer.agent_name, encode_notif(kind, remote_request_id))
                ok = True
            except Exception as e:
                logger.warning("NIXL notification to %s failed: %r", addr.engine_id, e)
        if ok:
            self._counters["num_notifs_sent"] += 1
        else:
            self._counters["num_notif_failures"] += 1

    # ---- prefill side -----------------------------------------------------------

    def _received_notifs(self) -> list[tuple[str, str]]:
        """``(kind, request_id)`` from the side channel and from NIXL. Calling
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
        for kind, request_id in self._received_notifs():
            send = self._sends.get(request_id)
            if kind == NOTIF_RENEW:
                if send is not None:
                    send.lease_deadline_mono = max(
                        send.lease_deadline_mono, now + self.config.lease_s
                    )
                    self._counters["num_lease_renewals"] += 1
            elif send is not None:
                del self._sends[request_id]
                self._done_sending.add(request_id)
            else:
                self._early_done[request_id] = now

    def _expire_leases(self) -> None:
        now = self._clock()
        for request_id, send in list(self._sends.items()):
            if now >= send.lease_deadline_mono:
                del self._sends[request_id]
                self._done_sending.add(request_id)
                self._counters["num_lease_expiries"] += 1
                logger.info("lease of request %s expired: freeing its blocks", request_id)
        stale = [r for r, t in self._early_done.items() if now - t > self.config.lease_s]
        for request_id in stale:
            del self._early_done[request_id]

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
