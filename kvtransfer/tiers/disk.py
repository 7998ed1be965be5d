"""The disk tier: segment files under the engine's directory, LRU by segment.

    <--kv-offloading-disk-dir>/<engine id>/
        fingerprint.json          model, dtype, layout, block shape, block size, hash
                                  algo, format (3: segments)
        segments/<name>.kvs       the blocks of one store batch (segments.py)

A store batch (the blocks the tier thread takes off its queue together: a step's
newly full blocks, each request's run in order) becomes one segment file; a load reads
each run of its blocks that sits consecutively in one segment with one ``preadv``
straight into the device blocks (``read_piece``), then checks every block's xxh3 on its
own: a bad block is a miss (recomputed) while the blocks before it load.

Eviction is by whole segment, least recently used first (a load touches the segments
it reads): the blocks of one segment were computed together and are mostly wanted
together, and freeing a file frees its bytes at once, so ``used_bytes`` is what the
files take on disk and ``--kv-offloading-disk-size`` bounds it. A block dropped on its
own (a failed checksum, ``reset``) leaves a hole: its bytes stay counted until the last
block of its segment goes and the file is deleted. A segment with a pinned block (a
load reading it) is not evicted.

At start the directory is re-indexed from the segments' header pages alone (oldest
modification first as least recently used); a fingerprint that differs from the
engine's (another model, layout, ..., or format 2's one file per block) is a start-up
error naming the flag, since its blocks would be another model's KV.

Not thread-safe by itself: ``TierStore`` changes the index under its lock and reads or
writes files outside it (a pinned key's segment stays put).
"""

from __future__ import annotations

import errno
import itertools
import json
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from tandem.kvtransfer.tiers import segments as seg_files
from tandem.kvtransfer.tiers.config import fingerprint_id
from tandem.kvtransfer.tiers.segment_reads import SegmentReader
from tandem.kvtransfer.tiers.segments import PAGE, Segment, SegmentWriter, stride

logger = logging.getLogger(__name__)

FLAG = "--kv-offloading-disk-dir"
_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
MAX_SEGMENT_BLOCKS = 64  # 16 MiB of 256 KiB blocks: one read per run, still fine-grained LRU
_names = itertools.count()


def header_bytes(num_keys: int, key_len: int = 32) -> int:
    """A segment's header pages for ``num_keys`` keys of ``key_len`` bytes."""
    return seg_files.header_bytes([bytes(key_len)] * num_keys)


def checksum(data: Any) -> int:
    """xxh3-64 of a block's bytes (a numpy array or anything with the buffer protocol)."""
    return xxhash.xxh3_64_intdigest(data)


def aligned_row(num_bytes: int, pin: bool = False) -> Any:
    """A uint8 buffer of ``num_bytes`` starting on a page boundary, as a page of the
    page cache does (a numpy array; ``pin``: a pinned torch tensor, for CUDA copies)."""
    if pin:
        import torch

        raw = torch.empty(num_bytes + PAGE, dtype=torch.uint8, pin_memory=True)
        skip = -raw.data_ptr() % PAGE
        return raw[skip : skip + num_bytes]
    raw = np.empty(num_bytes + PAGE, dtype=np.uint8)
    skip = -raw.ctypes.data % PAGE
    return raw[skip : skip + num_bytes]


def copy_bytes(dst: np.ndarray, src: np.ndarray) -> None:
    """Copy ``src`` into ``dst`` (uint8, same size) with a numpy ufunc's SIMD loop
    rather than ``memcpy`` (``np.copyto``): for large copies glibc's memcpy uses the
    CPU's string copy (``rep movsb``), which on the AMD EPYC box ran at about 2 GB/s
    when the two buffers sit at different offsets within a cache line, as a disk
    block read out of its file and a device block do; the ufunc copies them at 11-14
    GB/s. (``np.positive`` of an unsigned integer is the integer.)"""
    if dst.ctypes.data % 8 == 0 and src.ctypes.data % 8 == 0 and src.nbytes % 8 == 0:
        dst, src = dst.view(np.uint64), src.view(np.uint64)
    np.positive(src, out=dst)


class DiskFull(OSError):
    pass


class TierLoadError(Exception):
    """A block could not be read back whole: missing, torn, or its checksum differs."""


def _fail_full(fn: Callable[[], Any]) -> Any:
    """``fn()``, its ENOSPC / EDQUOT raised as DiskFull."""
    try:
        return fn()
    except OSError as exc:
        if exc.errno in _FULL_ERRNOS:
            raise DiskFull(exc.errno, str(exc)) from exc
        raise


class DiskTier:
    medium = "disk"

    def __init__(
        self,
        directory: str,
        engine_id: str,
        capacity_bytes: int,
        block_bytes: int,
        fingerprint: dict[str, Any],
        is_pinned: Callable[[bytes], bool],
    ) -> None:
        self.root = Path(directory) / engine_id
        self._dir = str(self.root / "segments")
        self.block_bytes = block_bytes
        self.stride = stride(block_bytes)
        self.capacity_bytes = capacity_bytes
        self.fingerprint = fingerprint
        self.fp_id = fingerprint_id(fingerprint)
        self._is_pinned = is_pinned
        # the most blocks a store batch puts in one segment: at most an eighth of the
        # tier, so that evicting one segment never empties it
        self.max_blocks = max(1, min(MAX_SEGMENT_BLOCKS, capacity_bytes // (8 * self.stride)))
        self.index: dict[bytes, tuple[Segment, int]] = {}  # key -> (segment, slot)
        self.segments: OrderedDict[str, Segment] = OrderedDict()  # least recent first
        self.used_bytes = 0  # the segments' files, and the reservations being written
        self.writing: dict[str, int] = {}  # segment name -> bytes reserved
        self.num_evictions = 0  # blocks
        self.num_reindexed = 0
        # TierStore: (medium, key, stored) on every index change (KV events)
        self.on_change: Callable[[str, bytes, bool], None] | None = None
        self.reader = SegmentReader(block_bytes, aligned_row, copy_bytes, checksum)
        self._open()

    # ---- start-up ------------------------------------------------------------------

    def _open(self) -> None:
        try:
            Path(self._dir).mkdir(parents=True, exist_ok=True)
            probe = self.root / ".probe"
            probe.write_bytes(b"ok")
            probe.unlink()
        except OSError as exc:
            raise ValueError(f"{FLAG}: {self.root} is not a writable directory ({exc})") from exc
        fp_path = self.root / "fingerprint.json"
        if fp_path.exists():
            try:
                found = json.loads(fp_path.read_text())
            except (OSError, ValueError) as exc:
                raise ValueError(
                    f"{FLAG}: {fp_path} is unreadable ({exc}); remove the directory or "
                    "point the flag elsewhere"
                ) from exc
            if found != self.fingerprint:
                diff = sorted(
                    k
                    for k in set(found) | set(self.fingerprint)
                    if found.get(k) != self.fingerprint.get(k)
                )
                raise ValueError(
                    f"{FLAG}: {self.root} holds KV blocks of another configuration "
                    f"(differs in {', '.join(diff)}: {[found.get(k) for k in diff]} there, "
                    f"{[self.fingerprint.get(k) for k in diff]} here); use another directory "
                    "or remove it"
                )
        else:
            fp_path.write_text(json.dumps(self.fingerprint, sort_keys=True))
        self._reindex()

    def _reindex(self) -> None:
        """Index every segment from its header pages; a block past the end of a file
        cut short is left out, a file with no usable block or header is removed."""
        found = seg_files.scan(self._dir, self.block_bytes, self.fp_id)
        # newest first: a key in two segments was stored again after its older copy was
        # dropped (a failed checksum), so the older copy is a hole
        kept = []
        for _, name, keys, checks, hlen, size in reversed(found):
            seg = Segment(name, keys, checks, hlen, size)
            for slot, key in enumerate(keys):
                whole = hlen + slot * self.stride + self.block_bytes <= size
                if whole and key not in self.index:
                    self.index[key] = (seg, slot)
                    seg.live.add(slot)
            if seg.live:
                kept.append(seg)
            else:
                self._unlink(seg)
        for seg in reversed(kept):  # least recently used (oldest) first
            self.segments[seg.name] = seg
            self.used_bytes += seg.size
        self.num_reindexed = len(self.index)
        while self.used_bytes > self.capacity_bytes and self._evict_one():
            pass
        if self.index:
            logger.info(
                "disk KV tier %s: %d blocks in %d segments re-indexed",
                self.root,
                len(self.index),
                len(self.segments),
            )

    # ---- index (under TierStore's lock) ----------------------------------------------

    def __contains__(self, key: bytes) -> bool:
        return key in self.index

    def path(self, seg: Segment) -> str:
        return f"{self._dir}/{seg.name}"

    def locate(self, key: bytes) -> tuple[Segment, int] | None:
        """Where ``key``'s block sits: its segment and slot."""
        return self.index.get(key)

    def touch(self, key: bytes) -> None:
        where = self.index.get(key)
        if where is not None:
            self.segments.move_to_end(where[0].name)

    def _evict_one(self) -> bool:
        """Remove the least recently used segment none of whose blocks is pinned."""
        for seg in self.segments.values():
            if not any(self._is_pinned(seg.keys[s]) for s in seg.live):
                break
        else:
            return False
        self.num_evictions += len(seg.live)
        for slot in sorted(seg.live):
            del self.index[seg.keys[slot]]
            self._changed(seg.keys[slot], False)
        seg.live.clear()
        self._free(seg)
        return True

    def _free(self, seg: Segment) -> None:
        del self.segments[seg.name]
        self.used_bytes -= seg.size
        self._unlink(seg)

    def _unlink(self, seg: Segment) -> None:
        try:
            os.unlink(self.path(seg))
        except FileNotFoundError:
            pass

    def _changed(self, key: bytes, stored: bool) -> None:
        if self.on_change is not None:
            self.on_change(self.medium, key, stored)

    def reserve(self, keys: list[bytes]) -> str | None:
        """Make room for a segment of ``keys`` (evicting least recently used segments):
        the new segment's name, or None when pinned blocks fill the tier."""
        size = seg_files.segment_bytes(keys, self.block_bytes)
        while self.used_bytes + size > self.capacity_bytes:
            if not self._evict_one():
                return None
        name = f"{time.time_ns():016x}-{next(_names):06d}{seg_files.SUFFIX}"
        self.used_bytes += size
        self.writing[name] = size
        return name

    def commit(self, name: str, writer: SegmentWriter | None, size: int = 0) -> None:
        """A reserved segment is written (``writer``: its keys and checksums, ``size``
        its bytes on disk) or abandoned (None); its blocks join the index, save those
        another segment already holds (holes)."""
        self.used_bytes -= self.writing.pop(name)
        if writer is None or not writer.keys:
            if writer is not None:
                self._unlink(Segment(name, [], [], 0, 0))
            return
        seg = Segment(name, writer.keys, writer.checks, writer.header, size)
        for slot, key in enumerate(writer.keys):
            if key not in self.index:
                self.index[key] = (seg, slot)
                seg.live.add(slot)
                self._changed(key, True)
        self.used_bytes += size
        self.segments[name] = seg
        if not seg.live:
            self._free(seg)

    def drop(self, key: bytes) -> None:
        """Forget one block (its bytes stay counted until its segment empties)."""
        where = self.index.pop(key, None)
        if where is None:
            return
        seg, slot = where
        seg.live.discard(slot)
        self._changed(key, False)
        if not seg.live:
            self._free(seg)

    # ---- files (outside the lock) -------------------------------------------------------

    def writer(self, name: str, keys: list[bytes]) -> SegmentWriter:
        """Open a reserved segment for writing (room in its header for ``keys``);
        DiskFull when the file system is full, OSError otherwise."""
        return _fail_full(lambda: SegmentWriter(self.path_of(name), keys, self.block_bytes))

    def path_of(self, name: str) -> str:
        return f"{self._dir}/{name}"

    def add(self, writer: SegmentWriter, key: bytes, payload: np.ndarray, check: int) -> bool:
        _fail_full(lambda: writer.add(key, payload, check))
        return True

    def finish(self, writer: SegmentWriter) -> int:
        return _fail_full(lambda: writer.finish(self.fp_id))

    def prefetch(self, keys: list[bytes]) -> None:
        """Ask the kernel to start reading these blocks now, each run of them in one
        segment as one range (a cold load then overlaps its reads)."""
        for seg, first, count in self.pieces(keys):
            self.advise(seg, first, count)

    def advise(self, seg: Segment, first: int, count: int) -> None:
        try:
            fd = os.open(self.path(seg), os.O_RDONLY)
        except OSError:
            return
        try:
            at = seg.offset(first, self.block_bytes)
            os.posix_fadvise(fd, at, count * self.stride, os.POSIX_FADV_WILLNEED)
        finally:
            os.close(fd)

    def pieces(self, keys: list[bytes]) -> list[tuple[Segment, int, int]]:
        """``keys`` (in order) as runs that sit consecutively in one segment: (segment,
        first slot, count) each; keys no longer indexed are left out."""
        out: list[list[Any]] = []
        for key in keys:
            where = self.index.get(key)
            if where is None:
                continue
            seg, slot = where
            last = out[-1] if out else None
            if last is not None and last[0] is seg and last[1] + last[2] == slot:
                last[2] += 1
            else:
                out.append([seg, slot, 1])
        return [(s, f, c) for s, f, c in out]

    def read_piece(self, seg: Segment, first: int, outs: list[np.ndarray]) -> list[bool]:
        """Read ``len(outs)`` consecutive blocks of ``seg`` from ``first`` into ``outs``
        (uint8, block_bytes each: device blocks) with one read (segment_reads.py: what
        the page cache holds straight in, the rest with one O_DIRECT read), checking
        each: per block, whether its xxh3 matches (a False block holds garbage: it is
        recomputed). TierLoadError when the read fails."""
        try:
            return self.reader.read(self.path(seg), seg, first, outs)
        except (OSError, ValueError) as exc:
            raise TierLoadError(f"disk segment unreadable: {exc}") from exc

    def read(self, key: bytes, out: np.ndarray) -> None:
        """Read one block straight into ``out``; TierLoadError when it is gone or bad."""
        where = self.index.get(key)
        if where is None:
            raise TierLoadError("disk block left the index")
        if not self.read_piece(where[0], where[1], [out])[0]:
            raise TierLoadError("disk block checksum mismatch")

    def row_bytes(self, key: bytes) -> int:
        """The staging row ``read_file`` needs."""
        return self.stride

    def read_file(self, key: bytes, row: Any) -> np.ndarray:
        """Read a block into ``row`` (uint8, page-aligned, ``row_bytes`` long; CUDA: a
        pinned row, copied to the device from there), check it, and return the block's
        bytes: a page-aligned view of ``row``. TierLoadError as ``read``."""
        block = np.asarray(row)[: self.block_bytes]
        self.read(key, block)
        return block

    def check_integrity(self) -> None:
        files = sum(seg.size for seg in self.segments.values())
        pending = sum(self.writing.values())
        assert files + pending == self.used_bytes, (
            f"disk tier accounting drift: {files}+{pending} != {self.used_bytes}"
        )
        assert self.used_bytes <= self.capacity_bytes, "disk tier over capacity"
        live = 0
        for seg in self.segments.values():
            assert seg.live, f"empty segment {seg.name} kept"
            for slot in seg.live:
                assert self.index.get(seg.keys[slot]) == (seg, slot), "segment/index drift"
            live += len(seg.live)
        assert live == len(self.index), "indexed blocks outside every segment"
