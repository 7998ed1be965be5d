"""TierStore: the index over the host and disk tiers and the thread that copies.

    engine loop thread                         tier thread (one per engine)
    match(keys) / pin(keys)   --lock-->        loads first, then stores:
    cancel(key) (block evicted)                  store: device block -> host slot
    submit_stores / submit_load  --queue-->             (-> disk file), checksum, commit
                                                 load:  host slot / disk file -> device
    poll() <- finished loads, bad blocks                 block, checksum verified

Stores never hold up a step: the loop thread only appends to a queue (a full
queue drops the store and counts it). A store copies a block the step before
computed; if the device cache evicts that block before the copy is committed,
``cancel`` marks the job and the copy is thrown away (the bytes may be torn).
A load is one request's run of blocks; its keys are pinned from admission to
the end of the load, so neither tier evicts them meanwhile. A load that misses
its deadline, finds a block gone or fails a checksum marks that block and the
rest of the run bad: the scheduler recomputes them (never wrong tokens).
On CUDA the copies run on a stream of their own and the host tier is pinned.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any

import numpy as np
import torch

from tandem.kvtransfer.tiers.config import TierConfig, fingerprint
from tandem.kvtransfer.tiers.disk import DiskFull, DiskTier, TierLoadError, checksum
from tandem.kvtransfer.tiers.host import HostTier
from tandem.scheduler.engine_stats import Histogram, KVOffloadStats, KVOffloadTierStats

logger = logging.getLogger(__name__)

LOAD_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
DISK_FULL_RETRY_S = 60.0


class StoreJob:
    __slots__ = ("block_id", "key", "cancelled")

    def __init__(self, block_id: int, key: bytes) -> None:
        self.block_id = block_id
        self.key = key
        self.cancelled = False


class LoadJob:
    __slots__ = ("req_id", "keys", "block_ids", "deadline", "cancelled")

    def __init__(self, req_id: str, keys: list[bytes], block_ids: list[int], deadline: float):
        self.req_id = req_id
        self.keys = keys
        self.block_ids = block_ids
        self.deadline = deadline
        self.cancelled = False


def _counters() -> dict[str, float]:
    return collections.defaultdict(float)


class TierStore:
    def __init__(self, config: TierConfig) -> None:
        self.config = config
        self.lock = threading.Lock()
        self.host: HostTier | None = None
        self.disk: DiskTier | None = None
        self.pins: collections.Counter[bytes] = collections.Counter()
        self.pending: dict[bytes, StoreJob] = {}  # stores queued or being copied
        self.counters = _counters()  # "<medium>_<what>" -> value
        self.load_seconds = Histogram(LOAD_BUCKETS_S)
        self._loads: collections.deque[LoadJob] = collections.deque()
        self._stores: collections.deque[StoreJob] = collections.deque()
        self._done: list[tuple[str, list[int]]] = []  # (req id, bad block ids)
        self._wake = threading.Condition(self.lock)
        self._busy = 0  # jobs taken off a queue, not finished
        self._stop = False
        self._thread: threading.Thread | None = None
        self._disk_full_until = 0.0
        self.kv: torch.Tensor | None = None  # [num_blocks, block_bytes] uint8 view
        self._stream: Any = None
        self._staging: torch.Tensor | None = None

    # ---- start and stop ------------------------------------------------------------------

    def open(self, kv_cache: torch.Tensor, storage_order: tuple[int, ...]) -> None:
        """Bind the engine's KV cache (the logical 6-d tensor; ``storage_order`` maps it
        to its contiguous storage), allocate the host tier, open the disk tier."""
        storage = kv_cache.permute(*storage_order)
        assert storage.is_contiguous(), "KV cache storage must be contiguous"
        num_blocks = storage.shape[0]
        self.kv = storage.reshape(num_blocks, -1).view(torch.uint8)
        block_bytes = self.kv.shape[1]
        cuda = kv_cache.device.type == "cuda"
        cfg = self.config
        if cfg.host_bytes:
            self.host = HostTier(cfg.host_bytes // block_bytes, block_bytes, cuda, self._pinned)
        if cfg.disk_dir:
            fp = fingerprint(
                cfg, str(kv_cache.dtype).removeprefix("torch."), tuple(storage.shape[1:])
            )
            self.disk = DiskTier(
                cfg.disk_dir, cfg.engine_id, cfg.disk_bytes, block_bytes, fp, self._pinned
            )
        self._staging = torch.empty((block_bytes,), dtype=torch.uint8, pin_memory=cuda)
        if cuda:
            self._stream = torch.cuda.Stream(device=kv_cache.device)
        self._thread = threading.Thread(target=self._run, name="kv-tiers", daemon=True)
        self._thread.start()

    def close(self) -> None:
        with self.lock:
            self._stop = True
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _pinned(self, key: bytes) -> bool:
        return self.pins[key] > 0

    # ---- the loop thread's side ------------------------------------------------------

    def match(self, keys: list[bytes]) -> int:
        """How many of ``keys`` (a prefix's consecutive block hashes) some tier holds."""
        host, disk = self.host, self.disk
        n = 0
        with self.lock:
            for k in keys:
                if (host is None or k not in host) and (disk is None or k not in disk):
                    break
                n += 1
        return n

    def pin(self, keys: list[bytes]) -> None:
        """Keep ``keys`` in their tiers until the load that reads them ends."""
        with self.lock:
            for k in keys:
                self.pins[k] += 1

    def submit_load(self, job: LoadJob) -> None:
        """Queue a load whose keys ``pin`` holds; the thread unpins them."""
        with self.lock:
            self._loads.append(job)
            self._wake.notify()

    def store_now(self, job: StoreJob) -> None:
        """Store on the caller's thread (store_policy "eviction": the block is about
        to be overwritten, so the copy cannot wait)."""
        self._store(job)

    def register(self, job: StoreJob) -> bool:
        """Track a store from the moment its block is published (before the step that
        computes it has run), so an eviction in any later schedule cancels it. False:
        a store of that key is already pending."""
        with self.lock:
            old = self.pending.get(job.key)
            if old is not None and not old.cancelled:
                return False
            self.pending[job.key] = job  # a cancelled one finishes unseen
            return True

    def _forget(self, job: StoreJob) -> None:
        """Under the lock: the job is done (or dropped)."""
        if self.pending.get(job.key) is job:
            del self.pending[job.key]

    def submit_stores(self, jobs: list[StoreJob]) -> None:
        """Queue registered jobs whose blocks are computed now; beyond the queue's
        bound they are dropped (counted), never waited for."""
        if not jobs:
            return
        with self.lock:
            room = max(self.config.max_store_queue - len(self._stores), 0)
            self._stores.extend(jobs[:room])
            for job in jobs[room:]:
                self._forget(job)
            if len(jobs) > room:
                self.counters["store_dropped"] += len(jobs) - room
            self._wake.notify()

    def wants(self, key: bytes) -> bool:
        """Would a store of ``key`` add it to a tier? (No lock: a stale answer costs one
        skipped or one redundant store.)"""
        job = self.pending.get(key)
        if job is not None and not job.cancelled:
            return False
        return (self.host is not None and key not in self.host) or (
            self.disk is not None and key not in self.disk and not self._disk_full()
        )

    def cancel(self, key: bytes) -> None:
        """The device block behind a pending store is being reused."""
        job = self.pending.get(key)
        if job is not None:
            job.cancelled = True

    def cancel_all(self) -> None:
        with self.lock:
            for job in self.pending.values():
                job.cancelled = True

    def reset(self) -> int:
        """Forget every stored block no load is reading (``reset_prefix_cache``: a
        benchmark's next run starts cold in every tier, not only on the device). Pending
        stores are cancelled; disk files are deleted. The number of blocks dropped."""
        dropped = 0
        with self.lock:
            for job in self.pending.values():
                job.cancelled = True
            for tier in (self.host, self.disk):
                if tier is None:
                    continue
                for key in [k for k in tier.index if not self._pinned(k)]:
                    tier.drop(key)
                    dropped += 1
            self.counters["resets"] += 1
        return dropped

    def poll(self) -> list[tuple[str, list[int]]]:
        with self.lock:
            done, self._done = self._done, []
        return done

    def queue_depth(self) -> int:
        return len(self._stores)

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every queued store and load is done (tests, benchmarks)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self.lock:
                if not self._stores and not self._loads and not self._busy:
                    return True
            time.sleep(0.002)
        return False

    # ---- the tier thread ---------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self.lock:
                while not self._stop and not self._loads and not self._stores:
                    self._wake.wait()
                if self._stop:
                    return
                job: Any = self._loads.popleft() if self._loads else self._stores.popleft()
                self._busy += 1
            try:
                if isinstance(job, LoadJob):
                    try:
                        bad = self._load(job)
                    except Exception:  # noqa: BLE001 - the request must still get its blocks
                        logger.exception("KV tier load of request %s failed", job.req_id)
                        self.counters["failures"] += 1
                        bad = list(job.block_ids)  # all recomputed
                    with self.lock:  # always: unpin and report, or the request would wait
                        for k in job.keys:
                            self.pins[k] -= 1
                            if not self.pins[k]:
                                del self.pins[k]
                        self._done.append((job.req_id, bad))
                else:
                    self._store(job)
            except Exception:  # noqa: BLE001 - the thread must outlive any one job
                logger.exception("KV tier job failed")
                self.counters["failures"] += 1
            finally:
                with self.lock:
                    self._busy -= 1

    def _copy(self, dst: torch.Tensor, src: torch.Tensor, sync: bool = True) -> None:
        """``sync=False`` (CUDA): leave the copy queued on the tier stream; the caller
        synchronizes it before the blocks are reported."""
        if self._stream is None:
            # numpy's memcpy: torch's copy_ of one uint8 row runs 0.04-0.3 GB/s on the
            # CPU box against 2.2 GB/s here (benchmarks/kv_tiers.py)
            np.copyto(dst.numpy(), src.numpy())
            return
        with torch.cuda.stream(self._stream):
            dst.copy_(src, non_blocking=True)
        if sync:
            self._stream.synchronize()

    def _disk_full(self) -> bool:
        return time.monotonic() < self._disk_full_until

    def _store(self, job: StoreJob) -> None:
        host, disk, key = self.host, self.disk, job.key
        assert self.kv is not None
        with self.lock:
            if job.cancelled:  # evicted before its copy began
                self.counters["store_cancelled"] += 1
                self._forget(job)
                return
            slot = None
            if host is not None and key not in host and not job.cancelled:
                slot = host.reserve()
            want_disk = (
                disk is not None
                and key not in disk
                and not self._disk_full()
                and not job.cancelled
                and disk.reserve(key)
            )
        if slot is None and not want_disk:
            with self.lock:
                self._forget(job)
            return
        row = host.data[slot] if slot is not None else self._staging
        try:
            self._copy(row, self.kv[job.block_id])
            payload = row.numpy()
            check = checksum(payload)
        except BaseException:
            with self.lock:  # give back what was reserved, then let _run log it
                if slot is not None:
                    host.release(slot)
                if want_disk:
                    disk.commit(key, False)
                self._forget(job)
            raise
        with self.lock:
            cancelled = job.cancelled  # the block was reused: the copy may be torn
            if slot is not None:
                if cancelled:
                    host.release(slot)
                else:
                    host.commit(key, slot, check)
                    self.counters["host_stored_bytes"] += host.block_bytes
                    self.counters["host_stored_blocks"] += 1
            if cancelled:
                self.counters["store_cancelled"] += 1
                if want_disk:
                    disk.commit(key, False)
                self._forget(job)
                return
        if want_disk:
            self._store_disk(key, payload, check)
        with self.lock:
            self._forget(job)

    def _store_disk(self, key: bytes, payload: np.ndarray, check: int) -> None:
        disk = self.disk
        ok = False
        try:
            disk.write(key, payload, check)
            ok = True
        except DiskFull as exc:
            self._disk_full_until = time.monotonic() + DISK_FULL_RETRY_S
            self.counters["disk_full"] += 1
            logger.warning(
                "disk KV tier %s is full (%s): disk stores stop for %.0f s; service goes on",
                disk.root,
                exc,
                DISK_FULL_RETRY_S,
            )
        except OSError as exc:
            self.counters["disk_store_failures"] += 1
            logger.warning("disk KV tier store failed: %s", exc)
        with self.lock:
            disk.commit(key, ok)
            if ok:
                self.counters["disk_stored_bytes"] += payload.nbytes
                self.counters["disk_stored_blocks"] += 1

    def _load(self, job: LoadJob) -> list[int]:
        """Copy the job's blocks in; returns the device block ids not loaded. On CUDA the
        host tier's copies are queued back to back and waited for once, at the end."""
        try:
            return self._load_blocks(job)
        finally:
            if self._stream is not None:
                self._stream.synchronize()

    def _load_blocks(self, job: LoadJob) -> list[int]:
        host, disk = self.host, self.disk
        start = time.monotonic()
        if disk is not None:
            with self.lock:
                cold = [k for k in job.keys if k in disk and (host is None or k not in host)]
            if len(cold) > 1:
                disk.prefetch(cold)
        for i, (key, block_id) in enumerate(zip(job.keys, job.block_ids, strict=True)):
            if job.cancelled or time.monotonic() > job.deadline:
                self.counters["load_timeouts"] += 1
                return job.block_ids[i:]
            with self.lock:
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
                    row = self._staging
                    disk.read(key, row.numpy())
                    medium = "disk"
                else:
                    raise TierLoadError("block left the tiers before its load")
            except TierLoadError as exc:
                logger.warning("KV tier load of request %s: %s; recomputing", job.req_id, exc)
                self.counters["load_failures"] += 1
                with self.lock:
                    if entry is not None:
                        host.drop(key)
                    elif on_disk:
                        disk.drop(key)
                return job.block_ids[i:]
            self._copy(self.kv[block_id], row, sync=medium == "disk")  # staging is reused
            self.counters[f"{medium}_loaded_bytes"] += row.numel()
            self.counters[f"{medium}_hits"] += 1
        with self.lock:
            self.load_seconds.observe(time.monotonic() - start)
        return []

    # ---- operators -----------------------------------------------------------------------

    FAILURES = {  # counter -> reason label of tandem:kv_offload_failures_total
        "load_failures": "load",
        "load_timeouts": "timeout",
        "store_dropped": "store_dropped",
        "store_cancelled": "store_cancelled",
        "disk_full": "disk_full",
        "disk_store_failures": "disk_write",
        "failures": "internal",
    }

    def report(self, loads_in_flight: int) -> KVOffloadStats:
        c = self.counters
        with self.lock:
            snapshot = self.load_seconds.snapshot()
        tiers = [
            KVOffloadTierStats(
                medium=t.medium,
                used_bytes=t.used_bytes,
                capacity_bytes=t.capacity_bytes,
                blocks=len(t.index),
                stored_bytes_total=c.get(f"{t.medium}_stored_bytes", 0.0),
                loaded_bytes_total=c.get(f"{t.medium}_loaded_bytes", 0.0),
                hits_total=c.get(f"{t.medium}_hits", 0.0),
                evictions_total=float(t.num_evictions),
            )
            for t in (self.host, self.disk)
            if t is not None
        ]
        return KVOffloadStats(
            tiers=tiers,
            store_queue_depth=len(self._stores),
            loads_in_flight=loads_in_flight,
            failures_total={r: c.get(k, 0.0) for k, r in self.FAILURES.items()},
            load_seconds=snapshot,
        )

    def stats(self) -> dict[str, float]:
        out = dict(self.counters)
        out["store_queue_depth"] = len(self._stores)
        for tier in (self.host, self.disk):
            if tier is not None:
                out[f"{tier.medium}_used_bytes"] = tier.used_bytes
                out[f"{tier.medium}_capacity_bytes"] = tier.capacity_bytes
                out[f"{tier.medium}_blocks"] = len(tier.index)
                out[f"{tier.medium}_evictions"] = tier.num_evictions
        return out

    def check_integrity(self, idle: bool = True) -> None:
        with self.lock:
            if self.host is not None:
                self.host.check_integrity()
            if self.disk is not None:
                self.disk.check_integrity()
            assert all(v > 0 for v in self.pins.values()), "negative tier pin"
            if idle:
                assert not self._loads and not self._busy, "tier loads still in flight"
                assert not self.pins, f"tier keys still pinned: {len(self.pins)}"
                assert not self._done, "finished tier loads nobody collected"
                if self.host is not None and not self.pending:
                    assert not self.host.reserved, "host tier slots reserved by no store"
