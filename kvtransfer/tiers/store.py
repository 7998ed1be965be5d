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

import msgspec
import torch

from tandem.kvtransfer.tiers.config import TierConfig, disk_name, fingerprint
from tandem.kvtransfer.tiers.copies import TierCopier
from tandem.kvtransfer.tiers.disk import DiskTier
from tandem.kvtransfer.tiers.host import HostTier
from tandem.kvtransfer.tiers.report import flat_stats, offload_stats
from tandem.scheduler.engine_stats import Histogram, KVOffloadStats

logger = logging.getLogger(__name__)

LOAD_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


class StoreJob(msgspec.Struct, array_like=True):
    """A device block to copy into the tiers (msgspec: it rides a step's plan to the
    other tensor-parallel ranks, kvtransfer/tiers/ranks.py)."""

    block_id: int
    key: bytes
    cancelled: bool = False


class LoadJob(msgspec.Struct, array_like=True):
    """One request's run of tier blocks to copy into its device blocks."""

    req_id: str
    keys: list[bytes]
    block_ids: list[int]
    deadline: float  # this process's time.monotonic()
    cancelled: bool = False


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
        self.kv: torch.Tensor | None = None  # [num_blocks, block_bytes] uint8 view
        self.copier = TierCopier(self)  # the tier thread's byte work (copies.py)
        # (medium, key, stored) index changes for the KV events; None: nobody routes
        self.events: list[tuple[str, bytes, bool]] | None = None

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
            try:
                self.disk = DiskTier(
                    cfg.disk_dir, disk_name(cfg), cfg.disk_bytes, block_bytes, fp, self._pinned
                )
            except ValueError as exc:  # names the flag
                if not cfg.disk_optional:
                    raise
                self.counters["disk_unusable"] += 1
                logger.warning(
                    "%s; --kv-offloading-disk-optional: serving %s",
                    exc,
                    "with the host KV tier only" if self.host else "without KV tiers",
                )
        for tier in self.tiers():
            tier.on_change = self._changed
            for key in tier.index:  # re-indexed from disk: routable at once
                self._changed(tier.medium, key, True)
        self.copier.open(block_bytes, kv_cache.device)
        self._thread = threading.Thread(target=self._run, name="kv-tiers", daemon=True)
        self._thread.start()

    def close(self) -> None:
        with self.lock:
            self._stop = True
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.copier.close()

    def _pinned(self, key: bytes) -> bool:
        return self.pins[key] > 0

    def tiers(self) -> list[Any]:
        return [t for t in (self.host, self.disk) if t is not None]

    # ---- KV events (the loop thread drains them into the engine's recorder) ---------

    def enable_events(self) -> None:
        """Record index changes from now on (the engine publishes KV events)."""
        with self.lock:
            if self.events is None:
                self.events = [(t.medium, k, True) for t in self.tiers() for k in t.index]

    def _changed(self, medium: str, key: bytes, stored: bool) -> None:
        """Under the lock (every index change is)."""
        if self.events is not None:
            self.events.append((medium, key, stored))

    def take_events(self) -> list[tuple[str, bytes, bool]]:
        with self.lock:
            if not self.events:
                return []
            events, self.events = self.events, []
            return events

    def tier_hashes(self) -> dict[str, list[bytes]]:
        """Every key each tier holds now, per medium (a KV events snapshot)."""
        with self.lock:
            return {t.medium: list(t.index) for t in self.tiers()}

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

    def unpin(self, keys: list[bytes]) -> None:
        with self.lock:
            self._unpin_locked(keys)

    def _unpin_locked(self, keys: list[bytes]) -> None:
        for k in keys:
            self.pins[k] -= 1
            if not self.pins[k]:
                del self.pins[k]

    def pin_host_prefix(self, keys: list[bytes]) -> tuple[list[bytes], list[int]]:
        """Pin the leading ``keys`` the host tier holds (an export, export.py): the
        keys and their slots."""
        host = self.host
        held: list[bytes] = []
        slots: list[int] = []
        with self.lock:
            for k in keys:
                entry = host.index.get(k) if host is not None else None
                if entry is None:
                    break
                self.pins[k] += 1
                host.touch(k)
                held.append(k)
                slots.append(entry.slot)
        return held, slots

    def submit_load(self, job: LoadJob) -> None:
        """Queue a load whose keys ``pin`` holds; the thread unpins them. A TP rank > 0
        queues it behind the stores sent before it (its blocks' copies, ranks.py)."""
        with self.lock:
            (self._stores if self.config.tp_rank else self._loads).append(job)
            self._wake.notify()

    def store_now(self, job: StoreJob) -> None:
        """Store on the caller's thread (store_policy "eviction": the block is about
        to be overwritten, so the copy cannot wait)."""
        self.copier.store(job)

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

    def forget(self, job: StoreJob) -> None:
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
                self.forget(job)
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
            self.disk is not None and key not in self.disk and not self.copier.disk_full()
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

    def next_load(self) -> LoadJob | None:
        """Under the lock: the load queued next, if any (the copier reads ahead)."""
        return self._loads[0] if self._loads else None

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
                job: Any = self._loads.popleft() if self._loads else _batch(self)
                self._busy += 1
            try:
                if isinstance(job, LoadJob):
                    try:
                        bad = self.copier.load(job)
                    except Exception:  # noqa: BLE001 - the request must still get its blocks
                        logger.exception("KV tier load of request %s failed", job.req_id)
                        self.counters["failures"] += 1
                        bad = list(job.block_ids)  # all recomputed
                    with self.lock:  # always: unpin and report, or the request would wait
                        self._unpin_locked(job.keys)
                        self._done.append((job.req_id, bad))
                else:
                    self.copier.store_batch(job)
            except Exception:  # noqa: BLE001 - the thread must outlive any one job
                logger.exception("KV tier job failed")
                self.counters["failures"] += 1
            finally:
                with self.lock:
                    self._busy -= 1

    # ---- operators -----------------------------------------------------------------------

    def report(self, loads_in_flight: int) -> KVOffloadStats:
        return offload_stats(self, loads_in_flight)

    def stats(self) -> dict[str, float]:
        return flat_stats(self)

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


def _batch(store: TierStore) -> Any:
    """Under the lock: the next job of the store queue; a store comes with the stores
    queued behind it (one disk segment's worth), a TP rank's load alone."""
    job = store._stores.popleft()
    if not isinstance(job, StoreJob):
        return job
    batch = [job]
    cap = store.disk.max_blocks if store.disk is not None else 1
    queue = store._stores
    while len(batch) < cap and queue and isinstance(queue[0], StoreJob):
        batch.append(queue.popleft())
    return batch


def forget(store: TierStore, keys: list[bytes]) -> None:
    """Drop ``keys`` (those no load pins) from every tier of ``store`` (tensor
    parallelism: a block some rank failed to load, kvtransfer/tiers/ranks.py)."""
    with store.lock:
        for key, tier in [(k, t) for k in keys if not store.pins[k] for t in store.tiers()]:
            if key in tier:
                tier.drop(key)
