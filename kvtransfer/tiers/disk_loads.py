"""A CPU load's disk blocks as pieces: each run of the load's blocks that sits
consecutively in one segment file is one piece, read with one read
(``DiskTier.read_piece``, segment_reads.py: cached blocks buffered, the rest with one
O_DIRECT read), by the tier thread or, with ``disk_readers`` > 1, by reader threads at
once.

With reader threads a long run is cut into pieces of at least ``MIN_PIECE`` blocks so
that every reader has one; a piece is at most ``MAX_PIECE`` blocks (two ``iovec`` a
block at most, under the kernel's 1024) and at most what one staged read holds.
"""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tandem.kvtransfer.tiers.disk import TierLoadError

if TYPE_CHECKING:
    import numpy as np

    from tandem.kvtransfer.tiers.disk import DiskTier
    from tandem.kvtransfer.tiers.segments import Segment

MIN_PIECE = 8
MAX_PIECE = 256


@dataclass(eq=False)
class Piece:
    start: int  # index of its first block in the load
    seg: Segment
    slot: int  # its first block's slot in the segment
    count: int
    result: Any = None  # list[bool] (per block: checksum good), a Future, or an error


def plan(
    where: list[Any], readers: int, max_blocks: int = MAX_PIECE
) -> tuple[list[Piece], dict[int, Piece]]:
    """The load's disk blocks (``where``: per block, ``(segment, slot)`` for a disk
    block) as pieces of at most ``max_blocks`` (one staged read,
    segment_reads.py), and each disk block's piece by its index in the load."""
    total = sum(1 for w in where if isinstance(w, tuple))
    cap = MAX_PIECE if readers <= 1 else max(MIN_PIECE, -(-total // readers))
    cap = min(cap, MAX_PIECE, max_blocks)
    pieces: list[Piece] = []
    of: dict[int, Piece] = {}
    for i, w in enumerate(where):
        if not isinstance(w, tuple):
            continue
        seg, slot = w
        last = pieces[-1] if pieces else None
        if (
            last is not None
            and last.seg is seg
            and last.start + last.count == i
            and last.slot + last.count == slot
            and last.count < cap
        ):
            last.count += 1
        else:
            last = Piece(i, seg, slot, 1)
            pieces.append(last)
        of[i] = last
    return pieces, of


def start(
    disk: DiskTier,
    pieces: list[Piece],
    outs: list[np.ndarray],
    pool: concurrent.futures.ThreadPoolExecutor | None,
) -> None:
    """Hand every piece to the reader threads (``outs``: the load's device blocks)."""
    if pool is None:
        return
    for p in pieces:
        p.result = pool.submit(disk.read_piece, p.seg, p.slot, outs[p.start : p.start + p.count])


def block_ok(disk: DiskTier, piece: Piece, index: int, outs: list[np.ndarray]) -> bool:
    """Whether block ``index`` of the load (in ``piece``) arrived whole: reads the piece
    here if no reader did. TierLoadError when the piece's read failed."""
    if piece.result is None:
        try:
            piece.result = disk.read_piece(
                piece.seg, piece.slot, outs[piece.start : piece.start + piece.count]
            )
        except TierLoadError as exc:
            piece.result = exc
    elif isinstance(piece.result, concurrent.futures.Future):
        try:
            piece.result = piece.result.result()
        except TierLoadError as exc:
            piece.result = exc
    if isinstance(piece.result, TierLoadError):
        raise piece.result
    return piece.result[index - piece.start]


def settle(pieces: list[Piece]) -> None:
    """No read left running (a late one could land in a recomputed block)."""
    futures = [p.result for p in pieces if isinstance(p.result, concurrent.futures.Future)]
    for f in futures:
        f.cancel()
    concurrent.futures.wait(futures)
