"""One NIXL agent per worker rank, and the descriptor math of whole blocks.

The KV cache (one rank's shard) is one tensor in which block ``b`` of every
layer is the single region ``base + b * block_len`` (both layouts of
``compat.py``). A whole-block transfer is one descriptor per RUN of blocks
that are consecutive on both sides (head slices: ``tp_plan.py``)::

    local  [7, 8, 9, 3, 4]      runs: (7 <- 20, 2 blocks)
    remote [20, 21, 5, 6, 7]          (9 <- 5, 1 block)   21->5 breaks remote
                                      (3 <- 6, 2 blocks)  9->3 breaks local

All NIXL calls of the agent go through this class, behind one lock (NIXL
does not promise thread safety; handshake threads add peers while the loop
thread polls transfers).
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np

from tandem.kvtransfer.prepped_blocks import PreppedBlocks, count_runs, sorted_block_pairs
from tandem.kvtransfer.side_channel import RegionInfo
from tandem.kvtransfer.tp_plan import Descriptors

XferHandle = Any

logger = logging.getLogger(__name__)


def nixl_version() -> str:
    """The installed NIXL's version: from its package metadata (``nixl``, or the CUDA-specific
    ``nixl-cu12``/``nixl-cu13`` distributions), else "unknown" where the module was unpacked
    without metadata (the offline GPU image's ``gpu/setup.sh``)."""
    from importlib.metadata import PackageNotFoundError, version

    for name in ("nixl", "nixl-cu13", "nixl-cu12"):
        try:
            return version(name)
        except PackageNotFoundError:
            continue
    return "unknown (no package metadata)"


def split_block_runs(
    local_block_ids: list[int], remote_block_ids: list[int]
) -> list[tuple[int, int, int]]:
    """``(local_start, remote_start, num_blocks)`` per maximal run of blocks
    consecutive on both sides, in order."""
    if len(local_block_ids) != len(remote_block_ids):
        raise ValueError(
            f"{len(local_block_ids)} local vs {len(remote_block_ids)} remote block ids"
        )
    runs: list[tuple[int, int, int]] = []
    for local_id, remote_id in zip(local_block_ids, remote_block_ids):
        if runs:
            local_start, remote_start, length = runs[-1]
            if local_id == local_start + length and remote_id == remote_start + length:
                runs[-1] = (local_start, remote_start, length + 1)
                continue
        runs.append((local_id, remote_id, 1))
    return runs


def _rows(addrs: np.ndarray, lengths: np.ndarray, device_id: int) -> np.ndarray:
    """Nx3 ``(address, num_bytes, device_id)`` rows, as NIXL takes them."""
    rows = np.empty((len(addrs), 3), dtype=np.uint64)
    rows[:, 0] = addrs
    rows[:, 1] = lengths
    rows[:, 2] = device_id
    return rows


def make_agent_name(engine_id: str, epoch: int) -> str:
    """Unique per process incarnation, so NIXL never confuses two restarts."""
    return f"tandem-{engine_id}-e{epoch}-{uuid.uuid4().hex[:8]}"


class NixlAgent:
    """A NIXL agent with the worker's KV cache registered as one region."""

    def __init__(
        self,
        name: str,
        backends: tuple[str, ...] = ("UCX",),
        progress_thread: bool = False,
        prepped_reads: bool = False,
    ) -> None:
        from nixl._api import nixl_agent, nixl_agent_config

        self.name = name
        self._lock = threading.Lock()
        config = nixl_agent_config(enable_prog_thread=progress_thread, backends=list(backends))
        self._agent = nixl_agent(name, config)
        self._registered: Any = None
        # notifications taken by ``progress`` (another thread), kept for ``get_notifs``
        self._notif_backlog: dict[str, list[bytes]] = {}
        # whole-block READs from block lists prepared once (prepped_blocks.py)
        self._use_prepped = prepped_reads
        self._prepped: PreppedBlocks | None = None
        self.num_prepped_reads = 0  # READs posted from the prepared lists
        self.num_prepared_reads = 0  # READs whose lists NIXL prepared per transfer
        self.region: RegionInfo | None = None
        self.metadata = b""
        # the host KV tier (kvtransfer/tiers/), registered beside the KV cache so peers
        # READ its slots like blocks
        self.host_region: RegionInfo | None = None
        self._host_registered: Any = None
        # Test hooks, None in production. NIXL refuses to release a handle it
        # cannot cancel; on one host (UCX cma) or over TCP it always can, so
        # tests that need the refusal set these: returning True makes
        # ``release`` / ``remove_peer`` report a refusal without calling NIXL.
        self.test_refuse_release: Callable[[XferHandle], bool] | None = None
        self.test_refuse_remove_peer: Callable[[str], bool] | None = None

    def register(self, kv_cache: Any) -> RegionInfo:
        """Register a contiguous KV tensor whose first dim is the block (DRAM
        on CPU, VRAM on CUDA) once; returns where its blocks live."""
        if self._registered is not None:
            raise RuntimeError("the KV cache is already registered")
        if not kv_cache.is_contiguous():
            raise ValueError("the KV cache tensor must be contiguous")
        num_blocks = kv_cache.shape[0]
        device_id = kv_cache.get_device()
        region = RegionInfo(
            base_addr=kv_cache.data_ptr(),
            block_len=kv_cache[0].numel() * kv_cache.element_size(),
            num_blocks=num_blocks,
            device_id=max(device_id, 0),
            mem_type="DRAM" if device_id < 0 else "VRAM",
        )
        with self._lock:
            self._registered = self._agent.register_memory(kv_cache)
            self.metadata = self._agent.get_agent_metadata()
            if self._use_prepped:
                self._prepped = PreppedBlocks(self._agent, region)
        self.region = region
        return region

    def register_host(self, slots: Any) -> RegionInfo:
        """Register the host tier's ``[num_slots, block_bytes]`` uint8 tensor (DRAM,
        pinned on CUDA) after the KV cache; its slots have the cache's block length."""
        if self.region is None or self._host_registered is not None:
            raise RuntimeError("register the KV cache first, and the host tier once")
        if not slots.is_contiguous() or slots.shape[1] != self.region.block_len:
            raise ValueError("host tier slots must be contiguous whole blocks")
        region = RegionInfo(
            base_addr=slots.data_ptr(),
            block_len=self.region.block_len,
            num_blocks=slots.shape[0],
            device_id=0,
            mem_type="DRAM",
        )
        with self._lock:
            self._host_registered = self._agent.register_memory(slots)
            self.metadata = self._agent.get_agent_metadata()  # peers learn both memories
        self.host_region = region
        return region

    def add_peer(self, metadata: bytes, region: RegionInfo | None = None) -> str:
        """Add a peer's agent; with prepared lists and a ``region`` of blocks
        as long as ours (whole-block READs), prepare its block list now, so
        that its first READ does not (~90 ms for 131k blocks on CPU)."""
        with self._lock:
            name = self._agent.add_remote_agent(metadata)
            if (
                self._prepped is not None
                and region is not None
                and self.region is not None
                and region.block_len == self.region.block_len
            ):
                try:
                    self._prepped.prepare_peer(name, region)
                except Exception as e:  # the first READ tries again and fails its load
                    logger.warning("preparing the block list of %s failed: %r", name, e)
            return name

    def remove_peer(self, peer_name: str) -> None:
        """Forget the peer's metadata and disconnect; after it no transfer
        with that peer can start or land. Raises when NIXL refuses."""
        if self.test_refuse_remove_peer is not None and self.test_refuse_remove_peer(peer_name):
            raise RuntimeError(f"remove_remote_agent({peer_name}) refused (test hook)")
        with self._lock:
            if self._prepped is not None:
                self._prepped.drop_peer(peer_name)
            self._agent.remove_remote_agent(peer_name)

    @property
    def uses_prepped_lists(self) -> bool:
        """Whole-block READs go through ``start_block_read`` (prepared lists)."""
        return self._prepped is not None

    def start_read(
        self, peer_name: str, peer_region: RegionInfo, descs: Descriptors
    ) -> tuple[XferHandle, str]:
        """Post one READ of ``descs`` (absolute addresses, ``tp_plan``) from the
        peer into the local region, NIXL preparing both lists for this READ.
        Returns ``(handle, "DONE"|"PROC"|"ERR")``; NIXL errors raise.

        Between processes of one host UCX picks its ``cma`` transport
        (process_vm_readv): the kernel copies inside this call, which then
        returns "DONE". Over RDMA or TCP the READ proceeds in the background."""
        assert self.region is not None, "register the KV cache first"
        local = _rows(descs.local_addrs, descs.lengths, self.region.device_id)
        remote = _rows(descs.remote_addrs, descs.lengths, peer_region.device_id)
        with self._lock:
            local_descs = self._agent.get_xfer_descs(local, self.region.mem_type)
            remote_descs = self._agent.get_xfer_descs(remote, peer_region.mem_type)
            handle = self._agent.initialize_xfer("READ", local_descs, remote_descs, peer_name)
            self.num_prepared_reads += 1
            return handle, self._post_locked(handle)

    def start_block_read(
        self,
        peer_name: str,
        peer_region: RegionInfo,
        local_block_ids: list[int],
        remote_block_ids: list[int],
    ) -> tuple[XferHandle, str, int]:
        """Post one READ of whole blocks ``local[i] <- remote[i]`` from lists
        prepared once (``prepped_blocks.py``; needs ``prepped_reads``); ids
        in range (the caller checks). Returns ``(handle, state, descriptors
        NIXL posts: one per run)``; NIXL errors raise."""
        assert self.region is not None, "register the KV cache first"
        local, remote = sorted_block_pairs(local_block_ids, remote_block_ids)
        with self._lock:
            if self._prepped is None:
                raise RuntimeError("start_block_read needs prepped_reads=True")
            handle = self._prepped.make_read(peer_name, peer_region, local, remote)
            self.num_prepped_reads += 1
            return handle, self._post_locked(handle), count_runs(local, remote)

    def _post_locked(self, handle: XferHandle) -> str:
        try:
            return self._agent.transfer(handle)
        except Exception:
            self._release_locked(handle)
            raise

    def check(self, handle: XferHandle) -> str:
        """ "DONE", "PROC" or "ERR"; a NIXL exception counts as "ERR"."""
        with self._lock:
            try:
                return self._agent.check_xfer_state(handle)
            except Exception:
                return "ERR"

    def release(self, handle: XferHandle) -> bool:
        """Free a handle (cancelling it if still active). False if NIXL refused:
        then the READ may still land, and its local blocks must stay untouched."""
        if self.test_refuse_release is not None and self.test_refuse_release(handle):
            return False
        with self._lock:
            return self._release_locked(handle)

    def _release_locked(self, handle: XferHandle) -> bool:
        try:
            self._agent.release_xfer_handle(handle)
            return True
        except Exception:
            return False

    def send_notif(self, peer_name: str, message: bytes) -> None:
        with self._lock:
            self._agent.send_notif(peer_name, message)

    def get_notifs(self) -> dict[str, list[bytes]]:
        """New notifications per peer agent, including any a ``progress``
        call took since the last call, in arrival order."""
        with self._lock:
            self._take_notifs_locked()
            out, self._notif_backlog = self._notif_backlog, {}
            return out

    def progress(self) -> None:
        """Let UCX progress (serve peers' READs on two-sided transports) from
        any thread; notifications it receives wait for ``get_notifs``."""
        with self._lock:
            if self._agent is not None:
                self._take_notifs_locked()

    def _take_notifs_locked(self) -> None:
        for peer, messages in self._agent.get_new_notifs().items():
            self._notif_backlog.setdefault(peer, []).extend(messages)

    def close(self) -> None:
        """Deregister the KV cache and drop the agent. Idempotent."""
        with self._lock:
            if self._prepped is not None:
                self._prepped.close()
                self._prepped = None
            try:
                for registered in (self._host_registered, self._registered):
                    if registered is not None:
                        self._agent.deregister_memory(registered)
            finally:
                self._registered = self._host_registered = None
            self._agent = None
