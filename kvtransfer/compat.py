"""KV compatibility: two engines may exchange KV only if the bytes mean the
same thing on both sides. The hash covers everything that changes the
meaning or size of a block; the handshake compares it before connecting."""

from __future__ import annotations

import hashlib

import msgspec

# Bump when the wire protocol (handshake reply, notifications) or the byte
# meaning of a block changes.
CONNECTOR_VERSION = 1

# [num_blocks, num_layers, 2 (K, V), block_size, num_kv_heads, head_dim]
BLOCKS_FIRST_LAYOUT = "blocks_first:NLKBHD"


class KVLayout(msgspec.Struct, array_like=True, frozen=True):
    model_name: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    layout: str = BLOCKS_FIRST_LAYOUT
    connector_version: int = CONNECTOR_VERSION


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
