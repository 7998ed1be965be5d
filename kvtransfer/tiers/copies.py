"""The tier thread's copies: a store (device block -> host slot / disk file) and a load
(host slot / disk file -> device blocks), with their checksums and counters.

``TierStore`` owns the index, the lock and the queues; ``TierCopier`` does the byte
work one job at a time on the tier thread, taking the lock only to reserve, commit or
look up entries. On CUDA the copies run on a stream of their own (the host tier is
pinned); on CPU they are numpy memcpys.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from tandem.kvtransfer.tiers import device_copies
from tandem.kvtransfer.tiers.disk import (
    DiskFull,
    TierLoadError,
    aligned_row,
    checksum,
    copy_bytes,
)

if TYPE_CHECKING:
    from tandem.kvtransfer.tiers.store import LoadJob, StoreJob, TierStore

logger = logging.getLogger(__name__)

DISK_FULL_RETRY_S = 60.0


class TierCopier:
    def __init__(self, store: TierStore) -> None:
        self.owner = store
        self.stream: Any = None
        self.staging: torch.Tensor | None = None
        # one reader (CUDA, or disk_readers 1): a whole block file lands here, page
        # aligned (DiskTier.read_file; pinned on CUDA), and its block is copied on
        self.file_row: torch.Tensor | None = None
        self.disk_full_until = 0.0
        # CPU: a load's disk blocks are read by these threads at once, each through
        # its own staging row into its device block (the kernel overlaps the reads)
        self.readers: concurrent.futures.ThreadPoolExecutor | None = None

    def open(self, block_bytes: int, device: torch.device) -> None:
        cuda = device.type == "cuda"
        self.staging = torch.empty((block_bytes,), dtype=torch.uint8, pin_memory=cuda)
        if cuda:
            self.stream = torch.cuda.Stream(device=device)
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

    def copy(self, dst: torch.Tensor, src: torch.Tensor, sync: bool = True) -> None:
        """``sync=False`` (CUDA): leave the copy queued on the tier stream; the caller
        synchronizes it before the blocks are reported."""
        if self.stream is None:
            # numpy: torch's copy_ of one uint8 row ran 0.04-0.3 GB/s on the CPU box
            # (benchmarks/kv_tiers.py); a ufunc loop rather than memcpy (copy_bytes)
            copy_bytes(dst.numpy(), src.numpy())
            return
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
        if sync:
            self.stream.synchronize()

    # ---- stores --------------------------------------------------------------------------

    def store(self, job: StoreJob) -> None:
        s = self.owner
        host, disk, key, counters = s.host, s.disk, job.key, s.counters
        assert s.kv is not None
        with s.lock:
            if job.cancelled:  # evicted before its copy began
                counters["store_cancelled"] += 1
                s.forget(job)
                return
            slot = None
            if host is not None and key not in host and not job.cancelled:
                slot = host.reserve()
            want_disk = (
                disk is not None
                and key not in disk
                and not self.disk_full()
                and not job.cancelled
                and disk.reserve(key)
            )
        if slot is None and not want_disk:
            with s.lock:
                s.forget(job)
            return
        row = host.data[slot] if slot is not None else self.staging
        try:
            if self.stream is not None:  # CUDA: the host tier's check is the device's
                check = device_copies.store_checked(self, row, s.kv[job.block_id])
            else:
                self.copy(row, s.kv[job.block_id])
            payload = row.numpy()
            if self.stream is None or want_disk:  # disk files carry xxh3 on every device
                disk_check = checksum(payload)
            if self.stream is None:
                check = disk_check
        except BaseException:
            with s.lock:  # give back what was reserved, then let the thread log it
                if slot is not None:
                    host.release(slot)
                if want_disk:
                    disk.commit(key, False)
                s.forget(job)
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
                if want_disk:
                    disk.commit(key, False)
                s.forget(job)
                return
        if want_disk:
            self.store_disk(key, payload, disk_check)
        with s.lock:
            s.forget(job)

    def store_disk(self, key: bytes, payload: np.ndarray, check: int) -> None:
        s = self.owner
        disk, counters = s.disk, s.counters
        ok = False
        try:
            disk.write(key, payload, check)
            ok = True
        except DiskFull as exc:
            self.disk_full_until = time.monotonic() + DISK_FULL_RETRY_S
            counters["disk_full"] += 1
            logger.warning(
                "disk KV tier %s is full (%s): disk stores stop for %.0f s; service goes on",
                disk.root,
                exc,
                DISK_FULL_RETRY_S,
            )
        except OSError as exc:
            counters["disk_store_failures"] += 1
            logger.warning("disk KV tier store failed: %s", exc)
        with s.lock:
            disk.commit(key, ok)
            if ok:
                counters["disk_stored_bytes"] += payload.nbytes
                counters["disk_stored_blocks"] += 1

    # ---- loads ---------------------------------------------------------------------------

    def load(self, job: LoadJob) -> list[int]:
        """Copy the job's blocks in; returns the device block ids not loaded. On CUDA the
        host tier's copies are queued back to back and waited for once, at the end."""
        try:
            return self.load_blocks(job)
        finally:
            if self.stream is not None:
                self.stream.synchronize()

    def load_blocks(self, job: LoadJob) -> list[int]:
        if self.stream is not None:
            return device_copies.load_blocks(self, job)
        if self.readers is not None:
            return self.load_blocks_parallel(job)
        s = self.owner
        host, disk, counters = s.host, s.disk, s.counters
        start = time.monotonic()
        if disk is not None:
            with s.lock:
                cold = [k for k in job.keys if k in disk and (host is None or k not in host)]
            if len(cold) > 1:
                disk.prefetch(cold)
        for i, (key, block_id) in enumerate(zip(job.keys, job.block_ids, strict=True)):
            if job.cancelled or time.monotonic() > job.deadline:
                counters["load_timeouts"] += 1
                return job.block_ids[i:]
            with s.lock:
                entry = host.index.get(key) if host is not None else None
                on_disk = disk is not None and key in disk
                if entry is not None:
                    host.touch(key)
                elif on_disk:
                    disk.touch(key)
            try:
                if entry is not None:
                    row = host.data[entry.slot]
                    if checksum(row.numpy()) != entry.checksum:
                        raise TierLoadError("host block checksum mismatch")
                    medium = "host"
                elif on_disk:
                    row = self.file_block(key)
                    medium = "disk"
                else:
                    raise TierLoadError("block left the tiers before its load")
            except TierLoadError as exc:
                logger.warning("KV tier load of request %s: %s; recomputing", job.req_id, exc)
                counters["load_failures"] += 1
                with s.lock:
                    if entry is not None:
                        host.drop(key)
                    elif on_disk:
                        disk.drop(key)
                return job.block_ids[i:]
            self.copy(s.kv[block_id], row, sync=medium == "disk")  # file_row is reused
            counters[f"{medium}_loaded_bytes"] += row.numel()
            counters[f"{medium}_hits"] += 1
        with s.lock:
            s.load_seconds.observe(time.monotonic() - start)
        return []

    def load_blocks_parallel(self, job: LoadJob) -> list[int]:
        """CPU with a disk tier: the job's disk files are announced to the kernel at once
        (``posix_fadvise(WILLNEED)``: every read in flight together, the device's queue
        deep), then the reader threads read them, each file through its own staging row
        into its device block (``DiskTier.read``, checksum verified); host blocks are
        copied meanwhile. Then the blocks are judged in order: the first one
        missing, late or bad ends the load (it and the rest are recomputed). No read is
        left running when this returns: a late one could land in a recomputed block."""
        s = self.owner
        host, disk, counters, kv = s.host, s.disk, s.counters, s.kv
        assert self.readers is not None and disk is not None and kv is not None
        start = time.monotonic()
        where: list[Any] = []  # per block: its host entry, "disk", or None (gone)
        with s.lock:  # pinned keys stay; only this thread's stores evict
            for key in job.keys:
                entry = host.index.get(key) if host is not None else None
                if entry is not None:
                    host.touch(key)
                elif key in disk:
                    disk.touch(key)
                    entry = "disk"
                where.append(entry)
        cold = [job.keys[i] for i, entry in enumerate(where) if entry == "disk"]
        if len(cold) > 1:  # the kernel reads them all at once; the readers copy them out
            disk.prefetch(cold)
        reads = {
            i: self.readers.submit(disk.read, job.keys[i], kv[job.block_ids[i]].numpy())
            for i, entry in enumerate(where)
            if entry == "disk" and not job.cancelled
        }
        try:
            for i, (key, block_id) in enumerate(zip(job.keys, job.block_ids, strict=True)):
                entry = where[i]
                if job.cancelled or time.monotonic() > job.deadline:
                    counters["load_timeouts"] += 1
                    return job.block_ids[i:]
                try:
                    if entry is None:
                        raise TierLoadError("block left the tiers before its load")
                    if entry == "disk":
                        reads[i].result()
                        counters["disk_loaded_bytes"] += disk.block_bytes
                        counters["disk_hits"] += 1
                        continue
                    row = host.data[entry.slot]
                    if checksum(row.numpy()) != entry.checksum:
                        raise TierLoadError("host block checksum mismatch")
                except TierLoadError as exc:
                    logger.warning("KV tier load of request %s: %s; recomputing", job.req_id, exc)
                    counters["load_failures"] += 1
                    with s.lock:
                        if entry == "disk":
                            disk.drop(key)
                        elif entry is not None:
                            host.drop(key)
                    return job.block_ids[i:]
                self.copy(kv[block_id], row)
                counters["host_loaded_bytes"] += row.numel()
                counters["host_hits"] += 1
        finally:
            for future in reads.values():
                future.cancel()
            concurrent.futures.wait(list(reads.values()))
        with s.lock:
            s.load_seconds.observe(time.monotonic() - start)
        return []
