"""The tier thread's copies: a store (device block -> host slot / disk file) and a load
(host slot / disk file -> device blocks), with their checksums and counters.

``TierStore`` owns the index, the lock and the queues; ``TierCopier`` does the byte
work one job at a time on the tier thread, taking the lock only to reserve, commit or
look up entries. On CUDA the copies run on a stream of their own (the host tier is
pinned) and the host tier's check is computed on the device (device_copies.py); on CPU
they are numpy ufunc copies between numpy views of the device cache and the host tier,
made once (indexing a torch tensor and taking its numpy view cost several microseconds a
block, against about 20 for a 256 KiB copy).

On CPU every copy into or out of the host tier is checked by its block's xxh3-64
checksum, computed on the bytes just copied while the block is still in the core's cache.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from tandem.kvtransfer.tiers import device_copies, disk_loads, gather
from tandem.kvtransfer.tiers.disk import (
    DiskFull,
    TierLoadError,
    aligned_row,
    checksum,
    copy_bytes,
)

if TYPE_CHECKING:
    from tandem.kvtransfer.tiers.host import HostEntry
    from tandem.kvtransfer.tiers.store import LoadJob, StoreJob, TierStore

logger = logging.getLogger(__name__)

DISK_FULL_RETRY_S = 60.0


class TierCopier:
    def __init__(self, store: TierStore) -> None:
        self.owner = store
        self.stream: Any = None
        self.staging: torch.Tensor | None = None
        # CUDA: a whole block file lands here, pinned and page aligned
        # (DiskTier.read_file), and its block is copied on to the device
        self.file_row: torch.Tensor | None = None
        self.disk_full_until = 0.0
        self.announced: set[bytes] = set()  # the read-ahead of the last load (locate)
        # CPU: a load's disk blocks are read by these threads at once, each straight
        # into its device block (the kernel overlaps the reads)
        self.readers: concurrent.futures.ThreadPoolExecutor | None = None
        # CPU: numpy views, one row a block, of the device cache and the host tier;
        # *_words: the same rows as uint64 where both allow it (the ufunc copies 8
        # bytes a lane; made once, a view a copy costs a microsecond), else uint8
        self.kv_rows: np.ndarray | None = None
        self.host_rows: np.ndarray | None = None
        self.kv_words: np.ndarray | None = None
        self.host_words: np.ndarray | None = None

    def open(self, block_bytes: int, device: torch.device) -> None:
        cuda = device.type == "cuda"
        self.staging = torch.empty((block_bytes,), dtype=torch.uint8, pin_memory=cuda)
        if not cuda:  # numpy, not torch: torch's copy_ of one uint8 row ran 0.04-0.3 GB/s
            if self.owner.host is not None:
                self.host_rows = self.owner.host.data.numpy()
            self.kv_rows = self.owner.kv.numpy()
            rows = [r for r in (self.kv_rows, self.host_rows) if r is not None]
            words = block_bytes % 8 == 0 and all(r.ctypes.data % 8 == 0 for r in rows)
            self.kv_words = self.kv_rows.view(np.uint64) if words else self.kv_rows
            if self.host_rows is not None:
                self.host_words = self.host_rows.view(np.uint64) if words else self.host_rows
        if cuda:
            self.stream = torch.cuda.Stream(device=device)
            if self.owner.host is not None:  # the host loads' kernel, compiled now
                gather.warm_up(self.owner.host.data, device, self.stream)
        elif self.owner.disk is not None and self.owner.config.disk_readers > 1:
            self.readers = concurrent.futures.ThreadPoolExecutor(
                self.owner.config.disk_readers, thread_name_prefix="kv-tiers-read"
            )

    def file_block(self, key: bytes) -> torch.Tensor:
        """``key``'s block read through ``file_row`` (checked): a view of it, good until
        the next call (DiskTier.read_file)."""
        disk = self.owner.disk
        need = disk.row_bytes(key)
        if self.file_row is None or self.file_row.numel() < need:
            cuda = self.stream is not None
            row = aligned_row(need, pin=cuda)
            self.file_row = row if cuda else torch.from_numpy(row)
        row = self.file_row.numpy()
        block = disk.read_file(key, row)
        start = block.ctypes.data - row.ctypes.data
        return self.file_row[start : start + block.nbytes]

    def close(self) -> None:
        if self.readers is not None:
            self.readers.shutdown(wait=True, cancel_futures=True)

    def disk_full(self) -> bool:
        return time.monotonic() < self.disk_full_until

    # ---- stores --------------------------------------------------------------------------

    def copy_out(self, block_id: int, slot: int | None) -> np.ndarray:
        """CPU: copy a device block into a host slot (None: the staging row, a disk-only
        store); the copied bytes."""
        if slot is None:
            row = self.staging.numpy()
            copy_bytes(row, self.kv_rows[block_id])
            return row
        np.positive(self.kv_words[block_id], out=self.host_words[slot])  # a copy
        return self.host_rows[slot]

    def store(self, job: StoreJob) -> None:
        self.store_batch([job])

    def store_batch(self, jobs: list[StoreJob]) -> None:
        """Copy a batch of device blocks into the host tier (each its slot) and onto
        disk (together: one segment file, disk.py), in order."""
        s = self.owner
        host, disk = s.host, s.disk
        assert s.kv is not None
        slots: dict[int, int | None] = {}  # job index -> host slot (None: no host copy)
        disk_keys: list[bytes] = []
        with s.lock:
            for i, job in enumerate(jobs):
                if job.cancelled:  # evicted before its copy began
                    s.counters["store_cancelled"] += 1
                    s.forget(job)
                    continue
                slots[i] = host.reserve() if host is not None and job.key not in host else None
                if disk is not None and job.key not in disk and job.key not in disk_keys:
                    disk_keys.append(job.key)
            name = None
            if disk_keys and not self.disk_full():
                name = disk.reserve(disk_keys)
        writer = self._open_segment(name, disk_keys)
        try:
            for i, slot in slots.items():
                writer = self._store_one(jobs[i], slot, writer)
            if writer is not None and not writer.keys:  # every block cancelled
                writer.abort()
                writer = None
            if writer is not None:
                size = self._disk_io(lambda: disk.finish(writer))
                if size is None:
                    writer.abort()
                    writer = None
        except BaseException:
            if writer is not None:
                writer.abort()
                writer = None
            raise
        finally:
            with s.lock:
                for i in slots:
                    s.forget(jobs[i])
                if name is not None:
                    disk.commit(name, writer, size if writer is not None else 0)
                    if writer is not None:
                        s.counters["disk_stored_bytes"] += len(writer.keys) * disk.block_bytes
                        s.counters["disk_stored_blocks"] += len(writer.keys)
                        s.counters["disk_segments"] += 1

    def _open_segment(self, name: str | None, keys: list[bytes]) -> Any:
        if name is None:
            return None
        disk = self.owner.disk
        return self._disk_io(lambda: disk.writer(name, keys))

    def _disk_io(self, fn: Any) -> Any:
        """Run one disk write step; None (and a warning, a counter) when it failed."""
        s = self.owner
        try:
            return fn()
        except DiskFull as exc:
            self.disk_full_until = time.monotonic() + DISK_FULL_RETRY_S
            s.counters["disk_full"] += 1
            logger.warning(
                "disk KV tier %s is full (%s): disk stores stop for %.0f s; service goes on",
                s.disk.root,
                exc,
                DISK_FULL_RETRY_S,
            )
        except OSError as exc:
            s.counters["disk_store_failures"] += 1
            logger.warning("disk KV tier store failed: %s", exc)
        return None

    def _store_one(self, job: StoreJob, slot: int | None, writer: Any) -> Any:
        """Copy one block to its host ``slot`` and into the segment ``writer`` (None:
        no disk copy); the writer still in use (None after a failed write)."""
        s = self.owner
        host, disk, key, counters = s.host, s.disk, job.key, s.counters
        want_disk = writer is not None and key in writer.capacity and key not in writer.keys
        if slot is None and not want_disk:
            return writer
        try:
            if self.stream is not None:  # CUDA: the host tier's check is the device's
                row = host.data[slot] if slot is not None else self.staging
                check = device_copies.store_checked(self, row, s.kv[job.block_id])
                payload = row.numpy()
                if want_disk:  # disk files carry xxh3 on every device
                    disk_check = checksum(payload)
            else:
                payload = self.copy_out(job.block_id, slot)
                check = disk_check = checksum(payload)  # the bytes just copied: cached
        except BaseException:
            if slot is not None:
                with s.lock:  # give back what was reserved, then let the thread log it
                    host.release(slot)
            raise
        with s.lock:
            cancelled = job.cancelled  # the block was reused: the copy may be torn
            if slot is not None:
                if cancelled:
                    host.release(slot)
                else:
                    host.commit(key, slot, check)
                    counters["host_stored_bytes"] += host.block_bytes
                    counters["host_stored_blocks"] += 1
            if cancelled:
                counters["store_cancelled"] += 1
                return writer
        if want_disk and self._disk_io(lambda: disk.add(writer, key, payload, disk_check)) is None:
            writer.abort()
            return None
        return writer

    # ---- loads ---------------------------------------------------------------------------

    def load(self, job: LoadJob) -> list[int]:
        """Copy the job's blocks in; returns the device block ids not loaded. On CUDA the
        host tier's copies are queued back to back and waited for once, at the end."""
        try:
            return self.load_blocks(job)
        finally:
            if self.stream is not None:
                self.stream.synchronize()

    def load_host(self, block_id: int, entry: HostEntry) -> bool:
        """CPU: copy a host slot into a device block; False when the bytes fail the
        slot's checksum (the device block then holds garbage: it is recomputed).

        The copy first, then the checksum of the destination, which the copy left in
        the core's cache (a block of 256 KiB fits the L2): the check reads no DRAM, so
        a checked load costs little more than the copy (``checksum`` before the copy
        would read the slot from DRAM once more; benchmarks/kv_tiers.py's copy part)."""
        np.positive(self.host_words[entry.slot], out=self.kv_words[block_id])  # a copy
        return checksum(self.kv_rows[block_id]) == entry.checksum

    def locate(self, job: LoadJob) -> tuple[list[Any], list[bytes]]:
        """Per block of the job: its host entry, its disk place ``(segment, slot)``, or
        None (in no tier); and the disk-only keys of the load queued next (read ahead:
        announced to the kernel with this load's, so the device has work at the seam
        between two loads). One lock for the job: its keys are pinned, so no tier
        evicts them, and only this thread drops entries. The job's segments are touched
        last block first, so the head of a prefix stays the most recently used."""
        s = self.owner
        host, disk = s.host, s.disk
        where: list[Any] = []
        ahead: list[bytes] = []
        with s.lock:
            for key in job.keys:
                entry = host.index.get(key) if host is not None else None
                if entry is not None:
                    host.touch(key)
                elif disk is not None:
                    entry = disk.locate(key)
                where.append(entry)
            for key, entry in zip(reversed(job.keys), reversed(where), strict=True):
                if isinstance(entry, tuple):
                    disk.touch(key)
            nxt = s.next_load()
            if nxt is not None and disk is not None:
                ahead = [k for k in nxt.keys if k in disk and (host is None or k not in host)]
        return where, ahead

    def load_blocks(self, job: LoadJob) -> list[int]:
        """The job's blocks in order; the first one missing, late or bad ends the load
        (it and the rest are recomputed). A load's disk blocks are read by pieces, one
        ``preadv`` each run of them that sits consecutively in one segment
        (disk_loads.py); its cold ranges are announced to the kernel at once
        (``posix_fadvise(WILLNEED)``) with those of the load queued next. No read is
        left running when this returns: a late one could land in a recomputed block.
        CUDA: ``device_copies.load_blocks``."""
        if self.stream is not None:
            return device_copies.load_blocks(self, job)
        s = self.owner
        host, disk, counters = s.host, s.disk, s.counters
        start = time.monotonic()
        where, ahead = self.locate(job)
        cold = [job.keys[i] for i, entry in enumerate(where) if isinstance(entry, tuple)]
        # buffered reads only: the kernel's read-ahead would read what O_DIRECT reads
        if (len(cold) > 1 or ahead) and not disk.reader.direct:
            fresh = [k for k in cold if k not in self.announced] + ahead
            if fresh:
                disk.prefetch(fresh)
        self.announced = set(ahead)
        outs = [self.kv_rows[b] for b in job.block_ids]
        cap = disk.reader.max_blocks if disk is not None else 1
        pieces, piece_of = disk_loads.plan(where, s.config.disk_readers, cap)
        if not job.cancelled:
            disk_loads.start(disk, pieces, outs, self.readers)
        hits = {"host": 0, "disk": 0}
        try:
            for i, (key, block_id) in enumerate(zip(job.keys, job.block_ids, strict=True)):
                if job.cancelled or time.monotonic() > job.deadline:
                    counters["load_timeouts"] += 1
                    return job.block_ids[i:]
                entry = where[i]
                on_disk = isinstance(entry, tuple)
                try:
                    if entry is None:
                        raise TierLoadError("block left the tiers before its load")
                    if not on_disk:
                        if not self.load_host(block_id, entry):
                            raise TierLoadError("host block checksum mismatch")
                    elif not disk_loads.block_ok(disk, piece_of[i], i, outs):
                        raise TierLoadError("disk block checksum mismatch")
                except TierLoadError as exc:
                    logger.warning("KV tier load of request %s: %s; recomputing", job.req_id, exc)
                    counters["load_failures"] += 1
                    if entry is not None:
                        with s.lock:
                            (disk if on_disk else host).drop(key)
                    return job.block_ids[i:]
                hits["disk" if on_disk else "host"] += 1
        finally:
            disk_loads.settle(pieces)
            block_bytes = s.kv.shape[1]
            for medium, n in hits.items():
                if not n:
                    continue
                counters[f"{medium}_loaded_bytes"] += n * block_bytes
                counters[f"{medium}_hits"] += n
        with s.lock:
            s.load_seconds.observe(time.monotonic() - start)
        return []
