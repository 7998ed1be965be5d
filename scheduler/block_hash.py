"""Prefix-cache block hashes: one pure function shared by engines and gateway.

A full block's hash names the block *and its whole prefix*, so it chains:

    block 0  h0 = H( [nil, [t0 .. t15],  extra_keys(0)] )   extra_keys(0) = [cache_salt]
    block 1  h1 = H( [h0,  [t16 .. t31], extra_keys(1)] )   later blocks: [] today
    block 2  h2 = H( [h1,  [t32 .. t47], extra_keys(2)] )

The bracketed triple is encoded as MessagePack (``msgspec.msgpack``): the
parent hash as bytes (nil for the first block), the token ids as an array of
ints (1 byte each below 128, 3 below 65536, 5 below 2**32), the extra keys
as an array. The encoding is compact, deterministic across processes and
versions of Python, and never pickle. ``H`` is the algorithm:

    sha256     hashlib, 32-byte digest. Default: collision-resistant, so a
               hit can be trusted without comparing tokens, and the same in
               every process (the gateway can compute it for KV-aware routing).
    xxhash128  xxh3_128 of the same bytes, 16 bytes. Faster; not
               cryptographic, but 128 bits and process-independent.
    builtin    Python's ``hash()`` of the triple, 8 bytes. Fastest; 64 bits,
               not collision-resistant, and salted per process for str/bytes
               (PYTHONHASHSEED): only for benchmarks and trusted single-tenant use.

Extra keys are what besides the tokens decides the block's KV content or who
may share it. The first block carries the request's ``cache_salt``; because
every later hash chains through it, two requests share blocks only when
their salts are equal. Adapters (LoRA) or multimodal inputs would add their
keys in ``block_extra_keys``; nothing else changes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence

import msgspec

try:  # optional: only the xxhash128 algorithm needs it
    import xxhash
except ImportError:  # pragma: no cover - pinned in requirements-cpu.txt
    xxhash = None

BlockHash = bytes
HASH_ALGOS = ("sha256", "xxhash128", "builtin")

_encode = msgspec.msgpack.Encoder().encode


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def _xxhash128(data: bytes) -> bytes:
    return xxhash.xxh3_128_digest(data)


def encode_block(
    parent_hash: BlockHash | None, token_ids: Sequence[int], extra_keys: Sequence[object] = ()
) -> bytes:
    """The bytes a block hash digests: msgpack ``[parent, [tokens], [extra keys]]``."""
    return _encode((parent_hash, token_ids, extra_keys))


def hash_block_tokens(
    parent_hash: BlockHash | None,
    token_ids: Sequence[int],
    extra_keys: Sequence[object] = (),
    algo: str = "sha256",
) -> BlockHash:
    """Hash of one full block, chained to its parent's hash. A pure function
    of its arguments (for ``sha256`` / ``xxhash128`` also across processes).
    ``extra_keys`` may hold str, int, bytes (anything msgpack encodes)."""
    return get_block_hasher(algo)(parent_hash, token_ids, extra_keys)


def block_extra_keys(block_index: int, cache_salt: str | None) -> tuple[object, ...]:
    """Extra keys of block ``block_index`` of a request: the salt on block 0."""
    if block_index == 0 and cache_salt is not None:
        return (cache_salt,)
    return ()


def hash_request_blocks(
    token_ids: Sequence[int],
    block_size: int,
    *,
    cache_salt: str | None = None,
    algo: str = "sha256",
    prev_hashes: Sequence[BlockHash] = (),
    num_blocks: int | None = None,
) -> list[BlockHash]:
    """Hashes of the full blocks of ``token_ids`` after the ``prev_hashes``
    already known (so a caller extends its list as blocks fill), up to
    ``num_blocks`` blocks in all (default: every full block). Returns only
    the new hashes. Engines and the gateway both call this."""
    hasher = get_block_hasher(algo)
    num_full = len(token_ids) // block_size
    if num_blocks is not None:
        num_full = min(num_full, num_blocks)
    parent = prev_hashes[-1] if prev_hashes else None
    out: list[BlockHash] = []
    for i in range(len(prev_hashes), num_full):
        parent = hasher(
            parent,
            token_ids[i * block_size : (i + 1) * block_size],
            block_extra_keys(i, cache_salt),
        )
        out.append(parent)
    return out


def _builtin(
    parent_hash: BlockHash | None, token_ids: Sequence[int], extra_keys: Sequence[object]
) -> BlockHash:
    return hash((parent_hash, tuple(token_ids), tuple(extra_keys))).to_bytes(
        8, "little", signed=True
    )


def _make_hasher(
    digest: Callable[[bytes], bytes],
) -> Callable[[BlockHash | None, Sequence[int], Sequence[object]], BlockHash]:
    def hasher(
        parent_hash: BlockHash | None, token_ids: Sequence[int], extra_keys: Sequence[object]
    ) -> BlockHash:
        return digest(_encode((parent_hash, token_ids, extra_keys)))

    return hasher


_HASHERS: dict[str, Callable[[BlockHash | None, Sequence[int], Sequence[object]], BlockHash]] = {
    "sha256": _make_hasher(_sha256),
    "xxhash128": _make_hasher(_xxhash128),
    "builtin": _builtin,
}


def get_block_hasher(
    algo: str,
) -> Callable[[BlockHash | None, Sequence[int], Sequence[object]], BlockHash]:
    """``(parent_hash, token_ids, extra_keys) -> hash`` for ``algo``;
    ``ValueError`` naming the field for an unknown one or a missing library."""
    hasher = _HASHERS.get(algo)
    if hasher is None:
        raise ValueError(
            f"prefix_caching_hash_algo must be one of {', '.join(HASH_ALGOS)}, got {algo!r}"
        )
    if algo == "xxhash128" and xxhash is None:
        raise ValueError(
            "prefix_caching_hash_algo 'xxhash128' needs the xxhash package (pip install xxhash)"
        )
    return hasher
