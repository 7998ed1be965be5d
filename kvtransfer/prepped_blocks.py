"""Whole-block READs from descriptor lists NIXL prepared once.

``initialize_xfer`` makes NIXL check and prepare both descriptor lists of
every READ (which backend, which registration, the peer's remote keys).
For whole blocks the lists never change, so they are prepared once: this
engine's blocks when the KV cache is registered, a peer's blocks at its
first READ (dropped with the peer). A READ then names block indices only
(``make_prepped_xfer``), and NIXL merges entries adjacent on both sides
back into one descriptor per run::

    prepared once          local  [b0 b1 b2 ... bN]      peer  [p0 p1 ... pM]
    per READ               local idx [2 3 4 9]  <-  peer idx [7 8 9 1]
    NIXL transfers         (2..4 <- 7..9), (9 <- 1)      2 descriptors

Head-slice reads (engines of different TP sizes, ``tp_plan.py``) are not
whole blocks and keep ``initialize_xfer``. All methods run under the
agent's lock (``NixlAgent``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvtransfer.side_channel import RegionInfo


def block_rows(region: RegionInfo) -> np.ndarray:
    """Nx3 ``(address, block_len, device_id)``, one row per block."""
    rows = np.empty((region.num_blocks, 3), dtype=np.uint64)
    rows[:, 0] = region.base_addr + np.arange(region.num_blocks, dtype=np.uint64) * np.uint64(
        region.block_len
    )
    rows[:, 1] = region.block_len
    rows[:, 2] = region.device_id
    return rows


def block_indices(addrs: np.ndarray, lengths: np.ndarray, region: RegionInfo) -> np.ndarray | None:
    """The block index of every block the pieces ``(addrs, lengths)`` cover
    in ``region``, in order; None unless every piece is whole blocks inside it.
    A READ of a few runs takes a Python loop (a few microseconds, where each
    numpy call costs ~1-2 us of overhead); many pieces take whole-array numpy."""
    if len(lengths) <= _LOOP_MAX_PIECES:
        return _indices_loop(addrs, lengths, region)
    block_len = region.block_len
    starts, misaligned = np.divmod(np.asarray(addrs, dtype=np.int64) - region.base_addr, block_len)
    counts, partial = np.divmod(np.asarray(lengths, dtype=np.int64), block_len)
    if misaligned.any() or partial.any() or counts.min() <= 0 or starts.min() < 0:
        return None
    if (starts + counts).max() > region.num_blocks:
        return None
    if counts.max() == 1:
        return starts.astype(np.int32)
    first_of_piece = np.repeat(np.cumsum(counts) - counts, counts)
    within = np.arange(int(counts.sum())) - first_of_piece
    return (np.repeat(starts, counts) + within).astype(np.int32)


_LOOP_MAX_PIECES = 8


def _indices_loop(addrs: np.ndarray, lengths: np.ndarray, region: RegionInfo) -> np.ndarray | None:
    base, block_len, num_blocks = region.base_addr, region.block_len, region.num_blocks
    out = np.empty(int(np.sum(lengths)) // block_len, dtype=np.int32)
    pos = 0
    for addr, length in zip(np.asarray(addrs).tolist(), np.asarray(lengths).tolist()):
        start, misaligned = divmod(addr - base, block_len)
        count, partial = divmod(length, block_len)
        if misaligned or partial or count <= 0 or start < 0 or start + count > num_blocks:
            return None
        out[pos : pos + count] = np.arange(start, start + count, dtype=np.int32)
        pos += count
    return out


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
        local_addrs: np.ndarray,
        remote_addrs: np.ndarray,
        lengths: np.ndarray,
    ) -> Any | None:
        """A READ handle (not posted) of whole blocks, or None when the pieces
        are not whole blocks of both regions (the caller prepares them itself)."""
        local = block_indices(local_addrs, lengths, self.region)
        remote = block_indices(remote_addrs, lengths, peer_region)
        if local is None or remote is None:
            return None
        remote_list = self._peers.get(peer_name)
        if remote_list is None:
            rows = block_rows(peer_region)
            remote_list = self._agent.prep_xfer_dlist(peer_name, rows, peer_region.mem_type)
            self._peers[peer_name] = remote_list
        return self._agent.make_prepped_xfer("READ", self._local, local, remote_list, remote)

    def drop_peer(self, peer_name: str) -> None:
        handle = self._peers.pop(peer_name, None)
        if handle is not None:
            self._agent.release_dlist_handle(handle)

    def close(self) -> None:
        for peer_name in list(self._peers):
            self.drop_peer(peer_name)
        self._agent.release_dlist_handle(self._local)
