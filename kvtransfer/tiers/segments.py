"""The disk tier's segment files (format 3): the blocks one store batch wrote, together.

    <key-ordered name>.kvs
        header pages   magic "TKVS", version, block count, block bytes, header length,
                       xxh3-64 of the header, the fingerprint's id, then per block:
                       key length, the block's xxh3-64, its key (the chained block hash,
                       which carries the request's cache_salt); zeros to a 4 KiB boundary
        blocks         back to back, each starting on a 4 KiB boundary of the file
                       (stride: the block's bytes rounded up to a page)

Why one file per batch, not per block: a load's run of consecutive blocks that sit
consecutively in one segment is then ONE ``preadv`` straight into the device blocks,
and the kernel reads it as one sequential stream (benchmarks/kv_disk_patterns.py: the
disk delivers well under its sequential rate when every 256 KiB block is a file of its
own, whatever the readers do).

A segment is written to ``.tmp`` (blocks first, the header last) and renamed, so a
reader sees a whole segment or none. Each block keeps its own checksum: a block flipped
on disk fails it at load (a miss, recomputed) while its neighbours load. Re-indexing at
start reads only the header pages; blocks past the end of a file cut short are left out.
"""

from __future__ import annotations

import logging
import os
import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import xxhash

logger = logging.getLogger(__name__)

PAGE = 4096
MAGIC = b"TKVS"
VERSION = 3  # the fingerprint's "format" (config.py): another is a mismatch
_FIXED = struct.Struct("<4sHHIIIQ16s")  # magic, version, 0, count, block, header, xxh3, fp
_ENTRY = struct.Struct("<HQ")  # key length, the block's xxh3-64
_HASH_AT = 20  # where the header's own checksum sits in _FIXED
SUFFIX = ".kvs"


def stride(block_bytes: int) -> int:
    """Bytes between two blocks of a segment: a block rounded up to a page."""
    return -(-block_bytes // PAGE) * PAGE


def header_bytes(keys: list[bytes]) -> int:
    """The header pages of a segment holding ``keys``."""
    raw = _FIXED.size + sum(_ENTRY.size + len(k) for k in keys)
    return -(-raw // PAGE) * PAGE


def segment_bytes(keys: list[bytes], block_bytes: int) -> int:
    """A whole segment file of ``keys``' blocks: what it takes on disk."""
    return header_bytes(keys) + len(keys) * stride(block_bytes)


@dataclass(eq=False)
class Segment:
    """One segment file as the index knows it (DiskTier keeps these under its lock)."""

    name: str  # the file's name under the tier's directory
    keys: list[bytes]  # slot -> key (a slot whose block was dropped keeps its key)
    checks: list[int]  # slot -> the block's xxh3-64
    header: int  # header bytes: block i starts at header + i * stride
    size: int  # bytes on disk (reserved while it is being written)
    live: set[int] = field(default_factory=set)  # slots the index still serves

    def offset(self, slot: int, block_bytes: int) -> int:
        return self.header + slot * stride(block_bytes)


def pack_header(
    keys: list[bytes], checks: list[int], block_bytes: int, fp_id: str, hlen: int
) -> bytes:
    """The header pages (``hlen`` bytes, at least ``header_bytes(keys)``)."""
    body = b"".join(_ENTRY.pack(len(k), c) + k for k, c in zip(keys, checks, strict=True))
    fixed = _FIXED.pack(MAGIC, VERSION, 0, len(keys), block_bytes, hlen, 0, fp_id.encode())
    raw = bytearray(fixed + body + bytes(hlen - len(fixed) - len(body)))
    struct.pack_into("<Q", raw, _HASH_AT, xxhash.xxh3_64_intdigest(bytes(raw)))
    return bytes(raw)


def read_header(path: str, block_bytes: int, fp_id: str) -> tuple[list[bytes], list[int], int]:
    """The keys, checksums and header length of a segment file: its header pages only.
    ValueError when they are not a whole header of ours (of this block size and
    fingerprint)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        first = os.pread(fd, PAGE, 0)
        if len(first) < _FIXED.size:
            raise ValueError("short header")
        magic, version, _, count, bb, hlen, check, fp = _FIXED.unpack_from(first)
        if (magic, version, bb) != (MAGIC, VERSION, block_bytes) or fp != fp_id.encode():
            raise ValueError("not a segment of this configuration")
        if hlen % PAGE or hlen < PAGE or hlen > 1 << 26:
            raise ValueError("bad header length")
        raw = first + (os.pread(fd, hlen - PAGE, PAGE) if hlen > PAGE else b"")
    finally:
        os.close(fd)
    if len(raw) != hlen:
        raise ValueError("short header")
    zeroed = bytearray(raw)
    struct.pack_into("<Q", zeroed, _HASH_AT, 0)
    if xxhash.xxh3_64_intdigest(bytes(zeroed)) != check:
        raise ValueError("header checksum mismatch")
    keys, checks, at = [], [], _FIXED.size
    for _ in range(count):
        key_len, block_check = _ENTRY.unpack_from(raw, at)
        at += _ENTRY.size
        keys.append(bytes(raw[at : at + key_len]))
        checks.append(block_check)
        at += key_len
    if header_bytes(keys) > hlen:
        raise ValueError("bad header entries")
    return keys, checks, hlen


def scan(directory: str, block_bytes: int, fp_id: str) -> list[tuple]:
    """Every segment file of ``directory`` whose header is whole and ours, oldest
    modification first: (mtime, name, keys, checks, header bytes, file size) each. A
    ``.tmp`` (a write cut short by a crash) and a file with a bad header are removed."""
    found = []
    for entry in os.scandir(directory):
        path = entry.path
        if path.endswith(".tmp"):
            os.unlink(path)
            continue
        if not path.endswith(SUFFIX):
            continue
        try:
            keys, checks, hlen = read_header(path, block_bytes, fp_id)
            st = entry.stat()
        except (OSError, ValueError) as exc:
            logger.warning("disk KV tier: removing %s (%s)", path, exc)
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            continue
        found.append((st.st_mtime_ns, entry.name, keys, checks, hlen, st.st_size))
    return sorted(found)


class SegmentWriter:
    """Writes one segment: ``add`` each block (at its place after the header pages,
    which are written last by ``finish``), then ``finish`` renames it into place.
    OSError from any step (the caller aborts: ``abort`` removes the ``.tmp``)."""

    def __init__(self, path: str, capacity_keys: list[bytes], block_bytes: int) -> None:
        self.path = path
        self.tmp = path + ".tmp"
        self.block_bytes = block_bytes
        # room for every key the batch may hold: a block dropped meanwhile leaves the
        # header part-empty, never moves a block
        self.header = header_bytes(capacity_keys)
        self.capacity = set(capacity_keys)  # the keys it has room for
        self.keys: list[bytes] = []
        self.checks: list[int] = []
        self._pad = bytes(stride(block_bytes) - block_bytes)
        self.fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)

    def add(self, key: bytes, payload: Any, check: int) -> None:
        at = self.header + len(self.keys) * stride(self.block_bytes)
        buffers = [memoryview(payload)] + ([self._pad] if self._pad else [])
        want = stride(self.block_bytes)
        n = os.pwritev(self.fd, buffers, at)
        while n < want:  # a short write: the rest
            rest = (bytes(memoryview(payload).cast("B")) + self._pad)[n:]
            n += os.pwrite(self.fd, rest, at + n)
        self.keys.append(key)
        self.checks.append(check)

    def finish(self, fp_id: str) -> int:
        """Write the header, close and rename: the segment's size on disk."""
        head = pack_header(self.keys, self.checks, self.block_bytes, fp_id, self.header)
        os.pwrite(self.fd, head, 0)
        size = self.header + len(self.keys) * stride(self.block_bytes)
        os.close(self.fd)
        self.fd = -1
        os.replace(self.tmp, self.path)
        return size

    def abort(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        try:
            os.unlink(self.tmp)
        except FileNotFoundError:
            pass


def read_run(
    path: str, offset: int, outs: list[np.ndarray], block_bytes: int, pads: list[memoryview]
) -> None:
    """One ``preadv`` of consecutive blocks at ``offset`` of a segment straight into
    ``outs`` (uint8, block_bytes each), ``pads`` taking the bytes between blocks (one
    per gap; none when a block is a whole number of pages). OSError or ValueError
    (short read: a file cut short)."""
    buffers: list[Any] = []
    for i, out in enumerate(outs):
        buffers.append(memoryview(out))
        if pads and i < len(outs) - 1:
            buffers.append(pads[i])
    want = sum(len(b) for b in buffers)
    fd = os.open(path, os.O_RDONLY)
    try:
        n = os.preadv(fd, buffers, offset)
        while 0 < n < want:  # a short read: go on reading
            more = os.preadv(fd, _rest(buffers, n), offset + n)
            if not more:
                break
            n += more
    finally:
        os.close(fd)
    if n != want:
        raise ValueError("segment file cut short")


def _rest(buffers: list[Any], n: int) -> list[Any]:
    """What of ``buffers`` a read of ``n`` bytes left unfilled."""
    out = []
    for b in buffers:
        if n >= len(b):
            n -= len(b)
        else:
            out.append(b[n:])
            n = 0
    return out
