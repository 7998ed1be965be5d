"""KVTransferConfig: every knob of a KV connector, validated at construction.

Both halves of a connector read the same config. P and D of one deployment
must agree on ``lease_s`` (D assumes a renewal extends P's lease by it) and
on every compatibility field (checked at handshake, see ``compat.py``).
"""

from __future__ import annotations

import dataclasses
import socket

from tandem.kvtransfer.compat import KV_LAYOUTS
from tandem.kvtransfer.ucx.env import device_type

ROLES = ("prefill", "decode", "both")
LOAD_FAILURE_POLICIES = ("recompute", "fail")
NOTIFICATION_TRANSPORTS = ("side_channel", "nixl")
TRANSPORT_PROBES = ("auto", "on", "off")


@dataclasses.dataclass(frozen=True)
class KVTransferConfig:
    # which connector class the registry builds
    connector: str = "nixl"
    # "prefill" serves its KV, "decode" pulls remote KV, "both" does either
    role: str = "both"
    engine_id: str = "engine-0"
    # bumped by whoever restarts the engine; peers drop cached state when it changes
    epoch: int = 0
    # ZMQ side channel that serves handshakes (prefill/both roles); port 0 = pick a free one
    side_channel_host: str = "127.0.0.1"
    side_channel_port: int = 0
    # host written into kv_transfer_params; None = side_channel_host (or this
    # machine's address when binding a wildcard)
    advertise_host: str | None = None
    # P frees held blocks this long after the prefill finished unless D renews
    lease_s: float = 60.0
    # D stops using a lease this long before it would end by D's count: covers
    # the params' trip P -> gateway -> D, which D cannot measure (no shared
    # clock). None = min(2 s, lease_s / 4)
    lease_margin_s: float | None = None
    # D gives up on one load (handshake + read) after this long
    load_timeout_s: float = 30.0
    handshake_timeout_s: float = 5.0
    # what the scheduler does with a failed load: recompute on D, or finish with an error
    load_failure_policy: str = "recompute"
    block_size: int = 16
    # compatibility fields; None = taken from the registered KV tensor
    model_name: str = ""
    kv_dtype: str | None = None
    num_layers: int | None = None
    num_kv_heads: int | None = None
    head_dim: int | None = None
    # byte layout of the registered cache (compat.py): "blocks_first" | "head_major"
    kv_layout: str = "blocks_first"
    # Tensor parallelism: this worker is rank ``tp_rank`` of ``tp_size``; each
    # rank registers its own KV shard and serves its own side channel. With
    # tp_size > 1, ``num_kv_heads`` must be the MODEL's KV head count. Rank 0
    # is the lead: it holds P's sends and receives D's notifications.
    tp_size: int = 1
    tp_rank: int = 0
    # NIXL backends for the agent
    backends: tuple[str, ...] = ("UCX",)
    # Who serves peers' READs while the engine loop is busy (a long forward):
    # UCX over TCP and on GPUs needs the prefill process to progress (see
    # progress_poller.py). By default a Python thread calls into NIXL every
    # nixl_progress_poll_interval_s while blocks are held for a decode engine
    # (0 = no poller: only the loop's polls, every step). NIXL's own progress
    # thread also covers C calls that hold the GIL for long, but its Python API
    # makes it poll UCX with a zero timeout: a busy core per engine; on a
    # 2-core VM off is ~3x faster (benchmarks/kv_transfer.py). It replaces the poller.
    nixl_progress_thread: bool = False
    nixl_progress_poll_interval_s: float = 0.001
    # True: a decode engine's whole-block READs (equal TP, the common case) name
    # block ids into block lists NIXL prepared once (prepped_blocks.py); NIXL
    # merges the same runs as read_descriptors. False: descriptors from
    # addresses, NIXL preparing both lists per READ (always so for head slices).
    # On by measurement: ids -> handle takes 9-36 us vs 12-49 us on CPU
    # (benchmarks/kv_transfer.py "READ set-up"); vLLM's NIXL connector also
    # uses prepared lists on GPUs.
    nixl_prepped_reads: bool = True
    # where the KV cache lives ("cpu" or "cuda[:N]"): picks the UCX settings
    # the connector fills in (kvtransfer/ucx/env.py)
    device: str = "cpu"
    # start-up probe READ that reports UCX's transport (kvtransfer/ucx/probe.py):
    # "auto" = on when the KV cache is on CUDA, "on", "off"
    transport_probe: str = "auto"
    # How D tells P "done" / "renew". "side_channel" (ZMQ, default) keeps READs
    # one-sided; "nixl" (NIXL notifications) makes a READ after a notification
    # wait for P's loop unless P runs a progress thread (see side_channel.py).
    # A prefill engine accepts both.
    notification_transport: str = "side_channel"
    # Per-cluster secret: the side channel and D's sockets to it use CURVE
    # keys derived from it (wire/auth.py). None = plain ZMQ (development).
    cluster_secret: bytes | None = dataclasses.field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"KVTransferConfig.role must be one of {ROLES}, got {self.role!r}")
        if not self.engine_id or any(c.isspace() for c in self.engine_id):
            raise ValueError(
                f"KVTransferConfig.engine_id must be non-empty without spaces, got {self.engine_id!r}"
            )
        if not isinstance(self.epoch, int) or self.epoch < 0:
            raise ValueError(f"KVTransferConfig.epoch must be an int >= 0, got {self.epoch!r}")
        if not 0 <= self.side_channel_port < 65536:
            raise ValueError(
                f"KVTransferConfig.side_channel_port must be in 0..65535, got {self.side_channel_port}"
            )
        for name in ("lease_s", "load_timeout_s", "handshake_timeout_s"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"KVTransferConfig.{name} must be > 0, got {value!r}")
        if self.lease_margin_s is not None and not 0 <= self.lease_margin_s < self.lease_s:
            raise ValueError(
                f"KVTransferConfig.lease_margin_s must be in [0, lease_s={self.lease_s}), "
                f"got {self.lease_margin_s!r}"
            )
        if self.load_failure_policy not in LOAD_FAILURE_POLICIES:
            raise ValueError(
                f"KVTransferConfig.load_failure_policy must be one of {LOAD_FAILURE_POLICIES}, "
                f"got {self.load_failure_policy!r}"
            )
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(
                f"KVTransferConfig.block_size must be an int >= 1, got {self.block_size!r}"
            )
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"KVTransferConfig.{name} must be an int >= 1, got {value!r}")
        if self.kv_layout not in KV_LAYOUTS:
            raise ValueError(
                f"KVTransferConfig.kv_layout must be one of {KV_LAYOUTS}, got {self.kv_layout!r}"
            )
        if not isinstance(self.tp_size, int) or self.tp_size < 1:
            raise ValueError(f"KVTransferConfig.tp_size must be an int >= 1, got {self.tp_size!r}")
        if not isinstance(self.tp_rank, int) or not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(
                f"KVTransferConfig.tp_rank must be in 0..{self.tp_size - 1}, got {self.tp_rank!r}"
            )
        if self.tp_size > 1 and self.num_kv_heads is None:
            raise ValueError(
                "KVTransferConfig.num_kv_heads (the model's) is required with tp_size > 1"
            )
        if self.notification_transport not in NOTIFICATION_TRANSPORTS:
            raise ValueError(
                f"KVTransferConfig.notification_transport must be one of "
                f"{NOTIFICATION_TRANSPORTS}, got {self.notification_transport!r}"
            )
        if not (
            isinstance(self.nixl_progress_poll_interval_s, (int, float))
            and 0 <= self.nixl_progress_poll_interval_s <= 1
        ):
            raise ValueError(
                "KVTransferConfig.nixl_progress_poll_interval_s must be in [0, 1] "
                f"(0 = no poller), got {self.nixl_progress_poll_interval_s!r}"
            )
        device_type(self.device)  # ValueError naming KVTransferConfig.device
        if self.transport_probe not in TRANSPORT_PROBES:
            raise ValueError(
                f"KVTransferConfig.transport_probe must be one of {TRANSPORT_PROBES}, "
                f"got {self.transport_probe!r}"
            )
        if not self.backends:
            raise ValueError("KVTransferConfig.backends must name at least one NIXL backend")

    @property
    def resolved_lease_margin_s(self) -> float:
        if self.lease_margin_s is not None:
            return self.lease_margin_s
        return min(2.0, self.lease_s / 4)

    @property
    def runs_transport_probe(self) -> bool:
        if self.transport_probe == "auto":
            return device_type(self.device) == "cuda"
        return self.transport_probe == "on"

    @property
    def serves_kv(self) -> bool:
        """This engine hands out its KV to decode engines (needs a side channel)."""
        return self.role in ("prefill", "both")

    @property
    def pulls_kv(self) -> bool:
        return self.role in ("decode", "both")

    @property
    def is_lead_rank(self) -> bool:
        """Rank 0 holds the sends and speaks for the engine (notifications)."""
        return self.tp_rank == 0

    def resolved_advertise_host(self) -> str:
        """The host decode engines should connect to for handshakes."""
        if self.advertise_host:
            return self.advertise_host
        if self.side_channel_host in ("0.0.0.0", "*", "", "::"):
            return socket.gethostbyname(socket.gethostname())
        return self.side_channel_host
