"""KV compatibility: two engines may exchange KV only if the bytes mean the
same thing on both sides.

``KVLayout`` (hashed) holds what must MATCH between a prefill and a decode
engine: model, dtype, layer count, the model's KV head count, head dim,
block size, the byte layout of a block, the connector version. What may
DIFFER -- tensor-parallel size and which rank holds which heads -- is in
``RankLayout``, sent beside the hash in every rank's handshake and never
hashed: a TP=2 prefill engine and a TP=1 decode engine of the same model
have equal hashes.

Two byte layouts of a (per-rank) KV cache; both are the logical tensor
``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`` to the
attention code, they differ in strides::

    blocks_first  [blk, L, 2, bs, H, d]   a head slice of one block is
                                          L*2*bs pieces of (heads * d) elems
    head_major    [blk, H, L, 2, bs, d]   a head slice of one block is ONE
                                          piece of heads * L*2*bs*d elems

In both, block ``b`` of every layer is one contiguous region, so a whole
block (homogeneous TP) is one descriptor per run of blocks.
"""

from __future__ import annotations

import hashlib

import msgspec

# Bump when the wire protocol (handshake reply, notifications) or the byte
# meaning of a block changes. 2: per-rank layouts (tensor parallelism).
CONNECTOR_VERSION = 2

BLOCKS_FIRST = "blocks_first"  # [num_blocks, num_layers, 2 (K, V), block_size, kv heads, head_dim]
HEAD_MAJOR = "head_major"  # [num_blocks, kv heads, num_layers, 2 (K, V), block_size, head_dim]
KV_LAYOUTS = (BLOCKS_FIRST, HEAD_MAJOR)
# where each layout's bytes lie: storage dims as indices into the logical
# [blk, L, 2, bs, H, d] every user of the cache indexes
STORAGE_ORDER = {BLOCKS_FIRST: (0, 1, 2, 3, 4, 5), HEAD_MAJOR: (0, 4, 1, 2, 3, 5)}


class KVLayout(msgspec.Struct, array_like=True, frozen=True):
    """What must match between engines. ``num_kv_heads`` is the MODEL's count
    (all ranks together), not what one rank holds."""

    model_name: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    layout: str = BLOCKS_FIRST
    connector_version: int = CONNECTOR_VERSION


class RankLayout(msgspec.Struct, array_like=True, frozen=True):
    """What one worker rank holds; may differ between engines (not hashed).

    The rank holds KV heads ``[head_start, head_start + num_heads)`` of the
    model's ``num_kv_heads``. ``replicated``: the model has fewer KV heads
    than ``tp_size``, so each rank holds one whole head and several ranks
    hold the same one (see ``tp_plan.shard_for``)."""

    tp_size: int = 1
    rank: int = 0
    head_start: int = 0
    num_heads: int = 0
    replicated: bool = False


def compat_hash(layout: KVLayout) -> str:
    """Stable hex digest of every field of ``layout``."""
    return hashlib.sha256(msgspec.json.encode(layout)).hexdigest()[:32]


def describe_mismatch(local: KVLayout, remote: KVLayout) -> str:
    """Human-readable list of the fields that differ, e.g. for an error."""
    diffs = [
        f"{name}: local={getattr(local, name)!r} remote={getattr(remote, name)!r}"
        for name in local.__struct_fields__
        if getattr(local, name) != getattr(remote, name)
    ]
    return "; ".join(diffs) or "hash differs (same fields?)"
