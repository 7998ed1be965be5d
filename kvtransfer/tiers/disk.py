"""The disk tier: one file per KV block under the engine's directory, its own LRU.

    <--kv-offloading-disk-dir>/<engine id>/
        fingerprint.json          model, dtype, layout, block shape, block size, hash algo
        blocks/<2 hex>/<key hex>.kvb   header page + the block's bytes

    header page  magic "TKVB", version, key length, payload length, xxh3-64 checksum,
                 key, zeros up to the next multiple of 4 KiB
    block        the block's bytes, at that 4 KiB boundary (format 2; format 1 put
                 them right after the key, 56 bytes in)

A load reads a file with one ``readv`` straight into the device block: its bytes start
on a page of the file, so the kernel's copy out of the page cache runs from a page
boundary into a block that starts on a cache line, at matching offsets within a cache
line (the fast case of the CPU's string copy), and no staging copy follows. The block's
checksum is then taken on the bytes just read, still in the core's cache. The layout is
also the one ``O_DIRECT`` needs (the block at an aligned file offset).

A file is written to ``.tmp`` and renamed, so a reader sees a whole file or none;
a file torn by a crash, flipped on disk or renamed fails its checksum (or key)
at load: a miss, recomputed. At start the directory is re-indexed (files of the
right size, oldest modification first as least recently used); a fingerprint
that differs from the engine's is a start-up error naming the flag, since its
blocks would be another model's KV.

Not thread-safe by itself: ``TierStore`` changes the index under its lock and
reads or writes a file outside it.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import struct
import threading
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

logger = logging.getLogger(__name__)

FLAG = "--kv-offloading-disk-dir"
_HEADER = struct.Struct("<4sHHQQ")
_MAGIC = b"TKVB"
_VERSION = 2  # the fingerprint's "format" (config.py): another is a mismatch
_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
PAGE = 4096


def header_bytes(key_len: int) -> int:
    """A block file's header page(s): the header and key, padded to a page."""
    return -(-(_HEADER.size + key_len) // PAGE) * PAGE


def _rest(buffers: list[memoryview], n: int) -> list[memoryview]:
    """What of ``buffers`` a read of ``n`` bytes left unfilled."""
    out = []
    for b in buffers:
        if n >= len(b):
            n -= len(b)
        else:
            out.append(b[n:])
            n = 0
    return out


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
        self._blocks = str(self.root / "blocks")
        self.block_bytes = block_bytes
        self.file_bytes = 0  # set per key length on the first write / scan
        self.capacity_bytes = capacity_bytes
        self.fingerprint = fingerprint
        self._is_pinned = is_pinned
        self.index: OrderedDict[bytes, int] = OrderedDict()  # key -> file size
        self.used_bytes = 0
        self.writing: set[bytes] = set()
        self.num_evictions = 0
        self.num_reindexed = 0
        # TierStore: (medium, key, stored) on every index change (KV events)
        self.on_change: Callable[[str, bytes, bool], None] | None = None
        self._staging = threading.local()  # read(): each reader thread's own row
        self._open()

    # ---- start-up ------------------------------------------------------------------

    def _open(self) -> None:
        try:
            (self.root / "blocks").mkdir(parents=True, exist_ok=True)
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
        found = []
        for path in (self.root / "blocks").glob("*/*"):
            if path.suffix == ".tmp":
                path.unlink(missing_ok=True)  # a write cut short by a crash
                continue
            if path.suffix != ".kvb":
                continue
            try:
                key = bytes.fromhex(path.stem)
                st = path.stat()
            except (ValueError, OSError):
                continue
            if st.st_size != self.file_size(key):
                path.unlink(missing_ok=True)
                continue
            found.append((st.st_mtime_ns, key, st.st_size))
        for _, key, size in sorted(found):
            self.index[key] = size
            self.used_bytes += size
        self.num_reindexed = len(self.index)
        while self.used_bytes > self.capacity_bytes and self._evict_one():
            pass
        if self.index:
            logger.info("disk KV tier %s: %d blocks re-indexed", self.root, len(self.index))

    # ---- index (under TierStore's lock) ----------------------------------------------

    def __contains__(self, key: bytes) -> bool:
        return key in self.index

    def path(self, key: bytes) -> Path:
        return Path(self.file_name(key))

    def file_name(self, key: bytes) -> str:
        """``path`` as a string, without pathlib (a load opens one a block: pathlib's
        joins cost more than the open)."""
        h = key.hex()
        return f"{self._blocks}/{h[:2]}/{h}.kvb"

    def file_size(self, key: bytes) -> int:
        return header_bytes(len(key)) + self.block_bytes

    def touch(self, key: bytes) -> None:
        self.index.move_to_end(key)

    def _evict_one(self) -> bool:
        victim = next((k for k in self.index if not self._is_pinned(k)), None)
        if victim is None:
            return False
        self.used_bytes -= self.index.pop(victim)
        self.path(victim).unlink(missing_ok=True)
        self.num_evictions += 1
        self._changed(victim, False)
        return True

    def _changed(self, key: bytes, stored: bool) -> None:
        if self.on_change is not None:
            self.on_change(self.medium, key, stored)

    def reserve(self, key: bytes) -> bool:
        """Make room for one more file (evicting least recently used ones); False when
        the pinned files fill the tier."""
        size = self.file_size(key)
        while self.used_bytes + size > self.capacity_bytes:
            if not self._evict_one():
                return False
        self.used_bytes += size
        self.writing.add(key)
        return True

    def commit(self, key: bytes, ok: bool) -> None:
        self.writing.discard(key)
        size = self.file_size(key)
        if ok and key not in self.index:
            self.index[key] = size
            self._changed(key, True)
        else:
            self.used_bytes -= size

    def drop(self, key: bytes) -> None:
        size = self.index.pop(key, None)
        if size is not None:
            self.used_bytes -= size
            self.path(key).unlink(missing_ok=True)
            self._changed(key, False)

    # ---- files (outside the lock) -------------------------------------------------------

    def write(self, key: bytes, payload: np.ndarray, check: int) -> None:
        """Write one block's file; DiskFull when the file system is full."""
        path = self.path(key)
        tmp = path.with_suffix(".tmp")
        header = _HEADER.pack(_MAGIC, _VERSION, len(key), payload.nbytes, check) + key
        header += bytes(header_bytes(len(key)) - len(header))
        try:
            path.parent.mkdir(exist_ok=True)
            self._write_file(tmp, header, payload)
            os.replace(tmp, path)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            if exc.errno in _FULL_ERRNOS:
                raise DiskFull(exc.errno, str(exc)) from exc
            raise

    @staticmethod
    def _write_file(path: Path, header: bytes, payload: np.ndarray) -> None:
        with open(path, "wb") as f:
            f.write(header)
            f.write(memoryview(payload))

    def _head(self, hlen: int) -> tuple[memoryview, memoryview]:
        """This thread's buffers for ``read``: a header page and one byte past a block."""
        head = getattr(self._staging, "head", None)
        if head is None or len(head[0]) != hlen:
            head = self._staging.head = (memoryview(aligned_row(hlen)), memoryview(bytearray(1)))
        return head

    def prefetch(self, keys: list[bytes]) -> None:
        """Ask the kernel to start reading these blocks' files now, all at once (a cold
        load then overlaps its reads instead of waiting for each file in turn)."""
        for key in keys:
            try:
                fd = os.open(self.file_name(key), os.O_RDONLY)
            except OSError:
                continue
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
            finally:
                os.close(fd)

    def read(self, key: bytes, out: np.ndarray) -> None:
        """Read a block's file straight into ``out`` (uint8, block_bytes: the device
        block itself; on failure its bytes are garbage, and the block is recomputed):
        one ``readv`` into this thread's header page, ``out`` and a byte past it (a
        longer file is torn), then the checks. TierLoadError when the file is missing,
        of another key, torn or fails its checksum."""
        hlen = header_bytes(len(key))
        head, tail = self._head(hlen)
        self._readv(key, [head, memoryview(out), tail], hlen + self.block_bytes)
        self._check(key, head, out)

    def row_bytes(self, key: bytes) -> int:
        """The staging row ``read_file`` needs for ``key``'s file."""
        return self.file_size(key) + 1

    def read_file(self, key: bytes, row: Any) -> np.ndarray:
        """Read a block's file whole into ``row`` (uint8, page-aligned, ``row_bytes``
        long; CUDA: a pinned row, copied to the device from there), check it, and
        return the block's bytes: a page-aligned view of ``row``. TierLoadError as
        ``read``."""
        hlen = header_bytes(len(key))
        want = hlen + self.block_bytes
        view = memoryview(row)[: want + 1]  # a byte past the block: a longer file is torn
        self._readv(key, [view], want)
        block = np.frombuffer(view[hlen:want], dtype=np.uint8)
        self._check(key, view, block)
        return block

    def _readv(self, key: bytes, buffers: list[memoryview], want: int) -> None:
        """Fill ``buffers`` from ``key``'s file: exactly ``want`` bytes, or TierLoadError.
        One ``readv`` a file (plus one per short read): three system calls a block, no
        Python file object."""
        try:
            fd = os.open(self.file_name(key), os.O_RDONLY)
            try:
                n = os.readv(fd, buffers)
                while 0 < n < want:  # a short read: go on reading
                    more = os.readv(fd, _rest(buffers, n))
                    if not more:
                        break
                    n += more
            finally:
                os.close(fd)
        except OSError as exc:
            raise TierLoadError(f"disk block unreadable: {exc}") from exc
        if n != want:
            raise TierLoadError("disk block file has the wrong size")

    def _check(self, key: bytes, head: memoryview, block: np.ndarray) -> None:
        magic, version, key_len, length, check = _HEADER.unpack_from(head)
        if (magic, version, length) != (_MAGIC, _VERSION, self.block_bytes):
            raise TierLoadError("disk block file header is not ours")
        if head[_HEADER.size : _HEADER.size + len(key)] != key or key_len != len(key):
            raise TierLoadError("disk block file holds another block")
        if checksum(block) != check:  # the bytes just read: in the core's cache
            raise TierLoadError("disk block checksum mismatch")

    def check_integrity(self) -> None:
        total = sum(self.index.values())
        pending = sum(self.file_size(k) for k in self.writing)
        assert total + pending == self.used_bytes, (
            f"disk tier accounting drift: {total}+{pending} != {self.used_bytes}"
        )
        assert self.used_bytes <= self.capacity_bytes, "disk tier over capacity"
