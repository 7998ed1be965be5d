"""Worker side of the NIXL connector: the KV bytes move here.

One per engine rank. It owns the NIXL agent, the side channel (prefill engines serve
handshakes and hear notifications on it) and the peer table, registers the rank's KV cache,
and runs both roles each step:

- decode: ``nixl_reads.KVReads`` READs prefill engines' blocks into this rank's cache (read
  plans across tensor-parallel sizes, handshake queues, deadlines, quarantine of READs that
  may still land); ``nixl_notify.PrefillNotifier`` tells P's lead rank "done" or "renew";
- prefill: ``nixl_leases.SendLeases`` holds blocks for decode engines' READs until every
  decode rank said "done" or the lease ended.

Deadlines and leases are on this process's monotonic clock (``clock``). Notifications go over
the ZMQ side channel by default (see side_channel.py for why), or as NIXL notifications; P
accepts both.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable
from typing import Any

import zmq

from tandem.kvtransfer.base import KVConnectorWorkerSide
from tandem.kvtransfer.compat import STORAGE_ORDER, KVLayout, RankLayout, compat_hash
from tandem.kvtransfer.config import KVTransferConfig
from tandem.kvtransfer.nixl_agent import NixlAgent, make_agent_name
from tandem.kvtransfer.nixl_leases import SendLeases
from tandem.kvtransfer.nixl_meta import NixlConnectorMetadata, NotifKey, PeerAddr, decode_notif
from tandem.kvtransfer.nixl_notify import PrefillNotifier
from tandem.kvtransfer.nixl_peers import PeerTable
from tandem.kvtransfer.nixl_reads import KVReads
from tandem.kvtransfer.progress_poller import ProgressPoller
from tandem.kvtransfer.side_channel import (
    HandshakeInfo,
    NotificationSender,
    RegionInfo,
    SideChannelServer,
)
from tandem.kvtransfer.tp_plan import BlockGeometry, shard_for
from tandem.kvtransfer.ucx.env import apply_ucx_env
from tandem.kvtransfer.ucx.probe import TransportProbe
from tandem.kvtransfer.ucx.proto_info import TransportReport
from tandem.wire.auth import PlaneAuth
from tandem.wire.frames import FrameCounters

logger = logging.getLogger(__name__)


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
        self._geometry: BlockGeometry | None = None
        self._counters: dict[str, float] = collections.defaultdict(float)
        self._notifier_side = PrefillNotifier(
            config, self.agent, self._peers, self._notifier, self._counters
        )
        self._reads = KVReads(
            config, clock, self.agent, self._peers, self._notifier_side.notify, self._counters
        )
        self._leases = SendLeases(config, clock, self._counters)
        self._closed = False
        self._host_tier: Any = None  # set_host_tier
        # serves peers' READs while the loop is busy (progress_poller.py)
        self._poller: ProgressPoller | None = None
        if (
            config.serves_kv
            and not config.nixl_progress_thread
            and config.nixl_progress_poll_interval_s > 0
        ):
            self._poller = ProgressPoller(
                self.agent.progress,
                self._leases.any_held,
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
        self._reads.bind(self._layout, self._shard, self._geometry)
        self._peers.set_local_layout(self._layout, self._geometry.head_block_bytes)
        if self._host_tier is not None:  # before the handshake is published
            self.agent.register_host(self._host_tier)
        self._publish_handshake()

    def set_host_tier(self, slots: Any) -> None:
        """The engine's host KV tier (kvtransfer/tiers/host.py: a uint8 ``[num_slots,
        block_bytes]`` tensor), registered with this rank's agent beside the KV cache
        so peers READ an exported prefix from it (``remote_medium`` "host"). Call
        before ``register_kv_caches``: the first handshake a peer gets names both."""
        self._host_tier = slots

    def _publish_handshake(self) -> None:
        if self._server is None or self.agent.region is None:
            return
        assert self._layout is not None and self._shard is not None
        self._server.set_info(
            HandshakeInfo(
                engine_id=self.config.engine_id,
                epoch=self.config.epoch,
                agent_name=self.agent.name,
                agent_metadata=self.agent.metadata,
                compat_hash=compat_hash(self._layout),
                layout=self._layout,
                region=self.agent.region,
                rank=self._shard,
                host_region=self.agent.host_region,
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
        lead = self.config.is_lead_rank
        if self._leases.apply(metadata) and self._poller is not None:
            self._poller.wake()
        for spec in metadata.loads:
            self._reads.start_load(spec)
        for notify in metadata.notifies if lead else ():
            self._reads.start_notify(notify)

    def get_finished(self) -> tuple[set[str], set[str]]:
        if not self._closed:
            self._reads.poll_handshakes()
            self._reads.poll_loads()
            self._reads.poll_quarantine()
            if self.config.serves_kv:
                if self.config.is_lead_rank:
                    self._leases.on_notifs(self._received_notifs())
                else:  # receives nothing, but a decode rank's connection needs UCX progress
                    self.agent.get_notifs()
                self._leases.expire()
            elif self.config.notification_transport == "nixl":
                self.agent.get_notifs()  # progress UCX so queued notifications go out
        return self._leases.take_done(), self._reads.ledger.take_done()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._reads.ledger.take_error_blocks()

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
        out["num_blocks_held_for_transfer"] = float(self._leases.num_blocks_held())
        out["num_loads_in_flight"] = float(self._reads.in_flight())
        out["num_loads_quarantined"] = float(self._reads.quarantined())
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
        out = list(self._reads.ledger.load_records)
        self._reads.ledger.load_records.clear()
        return out

    def drain_transfer_seconds(self) -> list[float]:
        """Per-transfer seconds since the last call (for a histogram)."""
        out = list(self._reads.ledger.recent_transfer_s)
        self._reads.ledger.recent_transfer_s.clear()
        return out

    def check_integrity(self) -> None:
        """Idle engine: no load in flight or queued, no send held."""
        leftovers = {**self._reads.leftovers(), "sends held": self._leases.held()}
        leftovers = {k: v for k, v in leftovers.items() if v}
        if leftovers:
            raise AssertionError(f"NixlWorkerSide not idle: {leftovers}")

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._poller is not None:
            self._poller.close()
        self._reads.release_all()
        handshakes_idle = self._peers.close()
        self._notifier.close()
        if self._server is not None:
            self._server.close()
        if handshakes_idle:  # else a handshake thread may still hold a socket
            self._zmq.term()
        self.agent.close()
