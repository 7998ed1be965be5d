"""How fast this machine's disk serves the disk KV tier's read patterns, cold, without
the tier: what a layout could reach before its own costs (kvtransfer/tiers/disk.py).

    python benchmarks/kv_disk_patterns.py [--blocks 512 --block-kib 256 --repeats 3]

Blocks laid out as the tier's format 2 does (a 4 KiB header page, then the block), read
into page-aligned buffers after their pages were dropped from the page cache:
  - one file per block (the tier today, 256 subdirectories by the key's first byte),
    all announced at once with ``posix_fadvise(WILLNEED)``, then read with 1 or 4
    threads (``--disk-readers``), or read with ``O_DIRECT`` by 1 or 4 threads;
  - one file holding every block back to back (a layout of one file per run of
    blocks), read with ``O_DIRECT``, a run of 8 or 64 blocks a ``preadv``, or through
    the page cache after ``WILLNEED`` as the tier's segment files are (format 3), a run
    of 64 blocks a ``preadv`` on one thread or of 16 on 4 threads;
against the ceiling: one file of the blocks' bytes read sequentially (1 MiB reads, the
kernel's read-ahead), cold, measured after each row's round. Each figure is the median
of ``--repeats`` rounds; the ratio is the median of each round's rate over its ceiling.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._machine import machine  # noqa: E402

PAGE = 4096


def drop_page_cache(path: str | Path) -> None:
    """Write ``path`` back and drop its pages from the page cache: the next read is cold."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


class Layouts:
    def __init__(self, root: str, num_blocks: int, block_bytes: int) -> None:
        self.root, self.n, self.bb = root, num_blocks, block_bytes
        self.payload = os.urandom(block_bytes)
        self.header = bytes(PAGE)
        self.files: list[str] = []
        for i in range(num_blocks):
            name = (i * 2654435761 % 2**32).to_bytes(4, "little").hex() * 8  # spread
            d = f"{root}/blocks/{name[:2]}"
            os.makedirs(d, exist_ok=True)
            self.files.append(f"{d}/{name}.kvb")
            with open(self.files[-1], "wb") as f:
                f.write(self.header + self.payload)
        self.one = f"{root}/run.kvs"
        with open(self.one, "wb") as f:
            for _ in range(num_blocks):
                f.write(self.header + self.payload)
        os.sync()
        self.local = threading.local()

    def _bufs(self, num_bytes: int) -> list[mmap.mmap]:
        bufs = getattr(self.local, "bufs", None)
        if bufs is None or len(bufs[1]) < num_bytes:  # mmap: page-aligned
            # private and on huge pages where the kernel allows, as the engine's CPU KV
            # cache is (workers/runner/kv_cache.py): O_DIRECT pins each page it lands
            # in, and the shared 4 KiB pages of mmap's default halved those reads
            big = mmap.mmap(-1, num_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            big.madvise(mmap.MADV_HUGEPAGE)
            bufs = self.local.bufs = [mmap.mmap(-1, PAGE), big]
        return bufs

    def _per_file(self, path: str, flags: int) -> None:
        head, block = self._bufs(self.bb)
        fd = os.open(path, os.O_RDONLY | flags)
        try:
            assert os.preadv(fd, [head, block], 0) == PAGE + self.bb
        finally:
            os.close(fd)

    def _run(self, first: int, run: int, flags: int = os.O_DIRECT) -> None:
        size = run * (PAGE + self.bb)
        (buf,) = self._bufs(size)[1:]
        fd = os.open(self.one, os.O_RDONLY | flags)
        try:
            os.preadv(fd, [memoryview(buf)[:size]], first * (PAGE + self.bb))
        finally:
            os.close(fd)

    def pattern(self, name: str, threads: int, run: int = 0) -> float:
        """GB/s of the blocks' bytes, cold."""
        for p in [*self.files, self.one]:
            drop_page_cache(p)
        start = time.perf_counter()
        if name == "willneed":
            for p in self.files:
                fd = os.open(p, os.O_RDONLY)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
                os.close(fd)
        if name == "segment":  # the tier's format 3: announce a load's runs, then read
            fd = os.open(self.one, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
            os.close(fd)
            jobs = [(self._run, (i, run, 0)) for i in range(0, self.n, run)]
        elif run:
            jobs = [(self._run, (i, run)) for i in range(0, self.n, run)]
        else:
            flags = os.O_DIRECT if name == "direct" else 0
            jobs = [(self._per_file, (p, flags)) for p in self.files]
        if threads == 1:
            for fn, a in jobs:
                fn(*a)
        else:
            with concurrent.futures.ThreadPoolExecutor(threads) as ex:
                for f in [ex.submit(fn, *a) for fn, a in jobs]:
                    f.result()
        return self.n * self.bb / (time.perf_counter() - start) / 1e9

    def ceiling(self) -> float:
        big = f"{self.root}/seq.bin"
        with open(big, "wb") as f:
            for _ in range(self.n):
                f.write(self.payload)
        drop_page_cache(big)
        buf = bytearray(1 << 20)
        start = time.perf_counter()
        with open(big, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass
        gbs = self.n * self.bb / (time.perf_counter() - start) / 1e9
        os.unlink(big)
        return gbs


ROWS = (
    ("one file a block, WILLNEED, 1 thread", "willneed", 1, 0),
    ("one file a block, WILLNEED, 4 threads", "willneed", 4, 0),
    ("one file a block, O_DIRECT, 1 thread", "direct", 1, 0),
    ("one file a block, O_DIRECT, 4 threads", "direct", 4, 0),
    ("one file, O_DIRECT runs of 8 blocks, 1 thread", "run", 1, 8),
    ("one file, O_DIRECT runs of 8 blocks, 4 threads", "run", 4, 8),
    ("one file, O_DIRECT runs of 64 blocks, 1 thread", "run", 1, 64),
    ("one file, WILLNEED, runs of 64 blocks a preadv, 1 thread", "segment", 1, 64),
    ("one file, WILLNEED, runs of 16 blocks a preadv, 4 threads", "segment", 4, 16),
)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=512)
    ap.add_argument("--block-kib", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary dir)")
    args = ap.parse_args(argv)
    root = tempfile.mkdtemp(prefix="kv-disk-", dir=args.dir)
    try:
        lay = Layouts(root, args.blocks, args.block_kib * 1024)
        print(f"{machine()}; {args.blocks} blocks of {args.block_kib} KiB under {root}, "
              f"medians of {args.repeats} rounds, GB/s, cold")  # fmt: skip
        print("| pattern | read | ceiling | read / ceiling |\n| --- | --- | --- | --- |")
        for label, name, threads, run in ROWS:
            reads, ceilings = [], []
            for _ in range(args.repeats):
                reads.append(lay.pattern(name, threads, run))
                ceilings.append(lay.ceiling())
            ratio = statistics.median(r / c for r, c in zip(reads, ceilings, strict=True))
            print(f"| {label} | {statistics.median(reads):.2f} | "
                  f"{statistics.median(ceilings):.2f} | {ratio:.2f} |")  # fmt: skip
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
