"""Whole-block READs from descriptor lists NIXL prepared once.

``initialize_xfer`` makes NIXL check and prepare both descriptor lists of
every READ (which backend, which registration, the peer's remote keys).
For whole blocks the lists never change, so they are prepared once: this
engine's blocks when the KV cache is registered, a peer's blocks at its
handshake when its blocks are as long as ours (else at its first whole-block
READ, if any), dropped with the peer. A READ then names block ids only
(``make_prepped_xfer``), sorted by local block, and NIXL merges entries
adjacent on both sides into one descriptor per run (its telemetry's
``descCount``; ``tests/kvtransfer/test_prepped_reads.py``)::

    prepared once          local  [b0 b1 b2 ... bN]      peer  [p0 p1 ... pM]
    per READ               local ids [9 2 3 4]  <-  peer ids [1 7 8 9]
    sorted by local id     local ids [2 3 4 9]  <-  peer ids [7 8 9 1]
    NIXL transfers         (2..4 <- 7..9), (9 <- 1)      2 descriptors

The same runs, in the same order, as ``tp_plan.read_descriptors`` gives
whole blocks, without computing addresses. Head-slice reads (engines of
different TP sizes, ``tp_plan.py``) are not whole blocks and keep
``initialize_xfer``. All methods run under the agent's lock
(``NixlAgent``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tandem.kvtransfer.side_channel import RegionInfo


def block_rows(region: RegionInfo) -> np.ndarray:
    """Nx3 ``(address, block_len, device_id)``, one row per block."""
    rows = np.empty((region.num_blocks, 3), dtype=np.uint64)
    rows[:, 0] = region.base_addr + np.arange(region.num_blocks, dtype=np.uint64) * np.uint64(
        region.block_len
    )
    rows[:, 1] = region.block_len
    rows[:, 2] = region.device_id
    return rows


def sorted_block_pairs(
    local_block_ids: list[int], remote_block_ids: list[int]
) -> tuple[np.ndarray, np.ndarray]:
    """Both id lists as int32 arrays, ordered by local block id (a READ's
    blocks are distinct, so every order copies the same bytes)."""
    local = np.asarray(local_block_ids, dtype=np.int32)
    remote = np.asarray(remote_block_ids, dtype=np.int32)
    if local.shape != remote.shape:
        raise ValueError(f"{local.size} local vs {remote.size} remote block ids")
    order = np.argsort(local, kind="stable")
    return local[order], remote[order]


def count_runs(local: np.ndarray, remote: np.ndarray) -> int:
    """Runs of consecutive entries whose blocks follow each other on both
    sides: the descriptors NIXL merges ``(local, remote)`` into."""
    if local.size == 0:
        return 0
    breaks = (np.diff(local) != 1) | (np.diff(remote) != 1)
    return 1 + int(np.count_nonzero(breaks))


class PreppedBlocks:
    """This engine's prepared block list and one per peer agent."""

    def __init__(self, agent: Any, region: RegionInfo) -> None:
        self._agent = agent
        self.region = region
        self._local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", block_rows(region), region.mem_type)
        self._peers: dict[str, Any] = {}

    def make_read(
        self,
        peer_name: str,
        peer_region: RegionInfo,
        local_block_ids: np.ndarray,
        remote_block_ids: np.ndarray,
    ) -> Any:
        """A READ handle (not posted) of whole blocks ``local[i] <- remote[i]``
        (int32 arrays, ids in range: the caller checks)."""
        remote_list = self.prepare_peer(peer_name, peer_region)
        return self._agent.make_prepped_xfer(
            "READ", self._local, local_block_ids, remote_list, remote_block_ids
        )

    def prepare_peer(self, peer_name: str, peer_region: RegionInfo) -> Any:
        """The peer's prepared block list, made now if it is new."""
        remote_list = self._peers.get(peer_name)
        if remote_list is None:
            rows = block_rows(peer_region)
            remote_list = self._agent.prep_xfer_dlist(peer_name, rows, peer_region.mem_type)
            self._peers[peer_name] = remote_list
        return remote_list

    def drop_peer(self, peer_name: str) -> None:
        handle = self._peers.pop(peer_name, None)
        if handle is not None:
            self._agent.release_dlist_handle(handle)

    def close(self) -> None:
        for peer_name in list(self._peers):
            self.drop_peer(peer_name)
        self._agent.release_dlist_handle(self._local)
