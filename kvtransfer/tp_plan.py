"""Which bytes a decode rank reads from which prefill rank: pure planning, no I/O.

Heads of an engine with tensor-parallel size ``tp`` (``shard_for``)::

    num_kv_heads >= tp   rank r holds heads [r*k, (r+1)*k), k = num_kv_heads // tp
    num_kv_heads <  tp   rank r holds the ONE head r // rep, rep = tp // num_kv_heads;
                         ranks [h*rep, (h+1)*rep) all hold head h: its replicas,
                         the lowest of them is the canonical copy

Read plan of decode rank ``d`` (``plan_rank_reads``): every head of d's shard
is read exactly once, from exactly one prefill rank, whole-range::

    P holds head h on one rank           -> that rank
    P replicates h on ranks R = [h*rp, (h+1)*rp)
                                         -> R[i % rp], i = d's replica index of h
                                            (d - h*rd when D replicates h too, else 0:
                                            the canonical copy)

and consecutive heads from one prefill rank form one ``HeadRead``. So P's
replicas are never read twice into one D rank, homogeneous TP is always
"rank r reads rank r, whole blocks", and D's replicas of a head spread
over P's replicas of it instead of all hitting the canonical one.

    4 KV heads          D rank 0                 D rank 1
    P TP 1, D TP 2      P0 heads 0-1             P0 heads 2-3
    P TP 2, D TP 1      P0 heads 0-1, P1 2-3     -
    P TP 2, D TP 2      P0 heads 0-1 (whole)     P1 heads 2-3 (whole)
    1 KV head, P TP 2, D TP 1: D0 <- P0 head 0   (P1's replica is never read)

Descriptors (``read_descriptors``): a head slice of one block is one piece
in the head-major layout and ``L*2*bs`` pieces blocks-first (see
``compat.py``); pieces adjacent on BOTH sides are merged, so whole blocks
(homogeneous TP) become one descriptor per run of consecutive blocks.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from tandem.kvtransfer.compat import BLOCKS_FIRST, HEAD_MAJOR, KV_LAYOUTS, RankLayout


def shard_for(num_kv_heads: int, tp_size: int, rank: int) -> RankLayout:
    """The KV heads rank ``rank`` of a ``tp_size`` engine holds. Raises
    ``ValueError`` naming the field when the sizes cannot be split."""
    if not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"tensor_parallel_size must be an int >= 1, got {tp_size!r}")
    if not isinstance(rank, int) or not 0 <= rank < tp_size:
        raise ValueError(f"tp_rank must be in 0..{tp_size - 1}, got {rank!r}")
    if not isinstance(num_kv_heads, int) or num_kv_heads < 1:
        raise ValueError(f"num_kv_heads must be an int >= 1, got {num_kv_heads!r}")
    if num_kv_heads >= tp_size:
        if num_kv_heads % tp_size:
            raise ValueError(
                f"num_kv_heads={num_kv_heads} is not divisible by tensor_parallel_size={tp_size}"
            )
        per_rank = num_kv_heads // tp_size
        return RankLayout(tp_size, rank, rank * per_rank, per_rank, False)
    if tp_size % num_kv_heads:
        raise ValueError(
            f"tensor_parallel_size={tp_size} is not a multiple of num_kv_heads={num_kv_heads} "
            "(heads are replicated whole)"
        )
    return RankLayout(tp_size, rank, rank // (tp_size // num_kv_heads), 1, True)


@dataclasses.dataclass(frozen=True)
class HeadRead:
    """Read KV heads ``[head_start, head_start + num_heads)`` (model head ids)
    of every block from prefill rank ``src_rank``."""

    src_rank: int
    head_start: int
    num_heads: int


def _source_rank(head: int, num_kv_heads: int, p_tp: int, d_tp: int, d_rank: int) -> int:
    if num_kv_heads >= p_tp:
        return head // (num_kv_heads // p_tp)
    p_rep = p_tp // num_kv_heads
    replica = d_rank - head * (d_tp // num_kv_heads) if num_kv_heads < d_tp else 0
    return head * p_rep + replica % p_rep


def plan_rank_reads(num_kv_heads: int, p_tp: int, d_tp: int, d_rank: int) -> list[HeadRead]:
    """What decode rank ``d_rank`` reads, in head order (see module docstring)."""
    shard_for(num_kv_heads, p_tp, 0)  # validates P's split
    mine = shard_for(num_kv_heads, d_tp, d_rank)
    reads: list[HeadRead] = []
    for head in range(mine.head_start, mine.head_start + mine.num_heads):
        src = _source_rank(head, num_kv_heads, p_tp, d_tp, d_rank)
        last = reads[-1] if reads else None
        if last is not None and last.src_rank == src:
            reads[-1] = HeadRead(src, last.head_start, last.num_heads + 1)
        else:
            reads.append(HeadRead(src, head, 1))
    return reads


@dataclasses.dataclass(frozen=True)
class BlockGeometry:
    """What every rank of both engines agrees on (the hashed ``KVLayout``)."""

    layout: str
    num_layers: int
    block_size: int
    head_dim: int
    elem_size: int

    def __post_init__(self) -> None:
        if self.layout not in KV_LAYOUTS:
            raise ValueError(f"kv_layout must be one of {KV_LAYOUTS}, got {self.layout!r}")

    @property
    def head_block_bytes(self) -> int:
        """Bytes of one KV head in one block (K and V of every layer)."""
        return self.num_layers * 2 * self.block_size * self.head_dim * self.elem_size

    def block_len(self, num_heads: int) -> int:
        """Bytes of one block of a rank holding ``num_heads`` heads."""
        return num_heads * self.head_block_bytes

    def slice_pieces(self, shard_heads: int, first: int, count: int) -> tuple[np.ndarray, int]:
        """``(offsets, piece_bytes)``: where heads ``[first, first + count)`` of a
        shard of ``shard_heads`` heads lie inside one of its blocks, as equal
        pieces in (layer, K/V, slot) order -- the same cut on every shard, so
        the pieces of two shards pair up one to one."""
        if not (0 <= first and count >= 1 and first + count <= shard_heads):
            raise ValueError(f"heads [{first}, {first + count}) outside a {shard_heads}-head shard")
        if self.layout == HEAD_MAJOR:
            return np.array([first * self.head_block_bytes], dtype=np.int64), self.block_len(count)
        assert self.layout == BLOCKS_FIRST
        row = self.head_dim * self.elem_size  # one head of one (layer, K/V, slot)
        rows = np.arange(self.num_layers * 2 * self.block_size, dtype=np.int64)
        return (rows * shard_heads + first) * row, count * row


@dataclasses.dataclass
class Descriptors:
    """Equal-length pieces: ``local_addrs[i]`` <- ``remote_addrs[i]``, ``lengths[i]`` bytes."""

    local_addrs: np.ndarray
    remote_addrs: np.ndarray
    lengths: np.ndarray

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def num_bytes(self) -> int:
        return int(self.lengths.sum())


def coalesce(local: np.ndarray, remote: np.ndarray, lengths: np.ndarray) -> Descriptors:
    """Merge pieces that continue each other on both sides, in local address
    order: every piece is an independent copy, so a request whose runs come
    out of order (local [3, 4, 1, 2] <- remote [7, 8, 5, 6]) is one piece."""
    if len(lengths) <= 1:
        return Descriptors(local, remote, lengths)
    order = np.argsort(local, kind="stable")
    local, remote, lengths = local[order], remote[order], lengths[order]
    follows = (local[1:] == local[:-1] + lengths[:-1]) & (remote[1:] == remote[:-1] + lengths[:-1])
    starts = np.flatnonzero(np.concatenate(([True], ~follows)))
    return Descriptors(local[starts], remote[starts], np.add.reduceat(lengths, starts))


def read_descriptors(
    geometry: BlockGeometry,
    local: RankLayout,
    remote: RankLayout,
    read: HeadRead,
    local_block_ids: list[int],
    remote_block_ids: list[int],
    local_base: int = 0,
    remote_base: int = 0,
) -> Descriptors:
    """The pieces of ``read`` for ``local_block_ids[i] <- remote_block_ids[i]``,
    addresses from each region's base (0: offsets)."""
    if len(local_block_ids) != len(remote_block_ids):
        raise ValueError(
            f"{len(local_block_ids)} local vs {len(remote_block_ids)} remote block ids"
        )
    end = read.head_start + read.num_heads
    for side, shard in (("local", local), ("remote", remote)):
        if not (shard.head_start <= read.head_start and end <= shard.head_start + shard.num_heads):
            raise ValueError(
                f"heads [{read.head_start}, {end}) are not all on the {side} rank {shard.rank} "
                f"(it holds [{shard.head_start}, {shard.head_start + shard.num_heads}))"
            )
    if read.num_heads == local.num_heads == remote.num_heads:  # whole blocks both sides
        local_offsets = remote_offsets = np.zeros(1, dtype=np.int64)
        piece = geometry.block_len(read.num_heads)
    else:
        local_offsets, piece = geometry.slice_pieces(
            local.num_heads, read.head_start - local.head_start, read.num_heads
        )
        remote_offsets, _ = geometry.slice_pieces(
            remote.num_heads, read.head_start - remote.head_start, read.num_heads
        )
    lb = np.asarray(local_block_ids, dtype=np.int64)
    rb = np.asarray(remote_block_ids, dtype=np.int64)
    local_addrs = local_base + (lb[:, None] * geometry.block_len(local.num_heads) + local_offsets)
    remote_addrs = remote_base + (
        rb[:, None] * geometry.block_len(remote.num_heads) + remote_offsets
    )
    lengths = np.full(local_addrs.size, piece, dtype=np.int64)
    return coalesce(local_addrs.ravel(), remote_addrs.ravel(), lengths)
