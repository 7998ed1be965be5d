"""The host tier's copies on CUDA, checked on the device.

On CPU a host block's checksum is xxh3 of its bytes (``disk.checksum``), computed as it
is stored and verified before it is loaded. On CUDA that check would run on one host core
per block: xxh3 reads about 17 GB/s, a third of a PCIe link, and a host load measured
3-5 GB/s against a 55 GB/s pinned copy on an H200 (docs/gpu.md). Here the check runs
where the bytes are:

    store   device block --(device_checksums)--> its checksum, with the copy to the
            pinned host slot queued on the tier stream; one wait for both
    load    every host block of the request's run copied in by one kernel that reads the
            pinned slots (``gather.py``; tier stream), then one device_checksums over the
            blocks landed; one wait; the first block
            whose sum differs from the stored one ends the load there (it and the rest
            are recomputed, as a bad xxh3 does on CPU)

``device_checksums`` is a weighted sum of a block's 64-bit words, modulo 2**64, with a
fixed odd weight per word position: a changed word changes the sum (an odd weight is
invertible modulo 2**64), swapped words do too, and it is one elementwise product and a
row sum on the GPU. It guards against what the CPU's check guards against in host memory
(a torn or overwritten slot), not against an adversary. Disk files keep xxh3: a block
stored to disk on CUDA gets its xxh3 from the host copy, as on CPU.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import torch

from tandem.kvtransfer.tiers.disk import TierLoadError
from tandem.kvtransfer.tiers.gather import gather_rows

if TYPE_CHECKING:
    from tandem.kvtransfer.tiers.copies import TierCopier
    from tandem.kvtransfer.tiers.store import LoadJob

logger = logging.getLogger(__name__)

SEED = 0x6B7674  # the weights are fixed: a checksum stored is checked by the same weights
CHUNK_BYTES = 64 << 20  # device_checksums' scratch: at most this many bytes of products
_weights: dict[tuple[str, int], torch.Tensor] = {}


def _word_weights(num_words: int, device: torch.device) -> torch.Tensor:
    key = (str(device), num_words)
    w = _weights.get(key)
    if w is None:
        g = torch.Generator().manual_seed(SEED)
        w = torch.randint(-(2**62), 2**62, (num_words,), generator=g, dtype=torch.int64) | 1
        w = _weights[key] = w.to(device)
    return w


def device_checksums(blocks: torch.Tensor) -> torch.Tensor:
    """``[N, block_bytes]`` uint8 (``block_bytes`` a multiple of 8) -> ``[N]`` int64 on the
    blocks' device: sum of word_i * weight_i modulo 2**64 over each block's words."""
    words = blocks.view(torch.int64)
    weights = _word_weights(words.shape[1], words.device)
    out = torch.empty(words.shape[0], dtype=torch.int64, device=words.device)
    step = max(1, CHUNK_BYTES // max(blocks.shape[1], 1))
    for i in range(0, words.shape[0], step):
        torch.sum(words[i : i + step] * weights, dim=1, out=out[i : i + step])
    return out


def store_checked(copier: TierCopier, row: torch.Tensor, block: torch.Tensor) -> int:
    """Copy a device block to its pinned host ``row`` and return its device checksum,
    both queued on the tier stream and waited for once."""
    with torch.cuda.stream(copier.stream):
        check = device_checksums(block.view(1, -1))
        row.copy_(block, non_blocking=True)
        value = check.to("cpu", non_blocking=True)
    copier.stream.synchronize()
    return int(value[0])


def load_blocks(copier: TierCopier, job: LoadJob) -> list[int]:
    """``TierCopier.load_blocks`` on CUDA: host blocks copied back to back and checked
    together on the device; disk blocks as on CPU (read, xxh3-checked, copied). The
    run's entries are looked up under one lock (its keys are pinned: only this thread's
    stores evict), and the copies are queued inside one stream context."""
    s = copier.owner
    host, disk, counters, kv = s.host, s.disk, s.counters, s.kv
    start = time.monotonic()
    where: list[Any] = []  # per block: its host slot and checksum, "disk", or None (gone)
    with s.lock:
        for key in job.keys:
            entry = host.index.get(key) if host is not None else None
            if entry is not None:
                host.touch(key)
                where.append((entry.slot, entry.checksum))
            elif disk is not None and key in disk:
                disk.touch(key)
                where.append("disk")
            else:
                where.append(None)
    cold = [k for k, w in zip(job.keys, where, strict=True) if w == "disk"]
    if len(cold) > 1:
        disk.prefetch(cold)
    pending: list[tuple[int, bytes, int]] = []  # (index in the job, key, stored checksum)
    batch: list[tuple[int, int]] = []  # host (slot, block id) not yet queued: one gather
    with torch.cuda.stream(copier.stream):
        for i, (key, block_id) in enumerate(zip(job.keys, job.block_ids, strict=True)):
            if job.cancelled or time.monotonic() > job.deadline:
                counters["load_timeouts"] += 1
                _gather(copier, batch)
                return _settle(copier, job, pending, i)
            entry = where[i]
            if entry is not None and entry != "disk":
                batch.append((entry[0], block_id))
                pending.append((i, key, entry[1]))
                continue
            _gather(copier, batch)  # the host blocks before this one, in order
            try:
                if entry is None:
                    raise TierLoadError("block left the tiers before its load")
                row = copier.file_block(key)
            except TierLoadError as exc:
                logger.warning("KV tier load of request %s: %s; recomputing", job.req_id, exc)
                counters["load_failures"] += 1
                if entry == "disk":
                    with s.lock:
                        disk.drop(key)
                return _settle(copier, job, pending, i)
            kv[block_id].copy_(row, non_blocking=True)
            copier.stream.synchronize()  # file_row is reused
            counters["disk_loaded_bytes"] += row.numel()
            counters["disk_hits"] += 1
        _gather(copier, batch)
    failed = _settle(copier, job, pending, len(job.keys))
    if not failed:
        with s.lock:
            s.load_seconds.observe(time.monotonic() - start)
    return failed


def _gather(copier: TierCopier, batch: list[tuple[int, int]]) -> None:
    """Queue the copies of ``batch``'s host slots into their device blocks on the current
    (tier) stream: one kernel reading the pinned slots (``gather.py``), or one ``copy_``
    per block where the device cannot read them."""
    if not batch:
        return
    kv, data = copier.owner.kv, copier.owner.host.data
    slots, block_ids = zip(*batch)
    if len(batch) == 1 or not gather_rows(
        data, kv, _index(slots, kv.device), _index(block_ids, kv.device)
    ):
        for slot, block_id in batch:
            kv[block_id].copy_(data[slot], non_blocking=True)
    batch.clear()


def _index(values: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """An int64 index on ``device`` through pinned memory (no host wait)."""
    return torch.tensor(values, dtype=torch.int64).pin_memory().to(device, non_blocking=True)


def _settle(copier: TierCopier, job: LoadJob, pending: list[Any], end: int) -> list[int]:
    """Check the host blocks copied so far; the job's block ids not loaded: from the first
    bad host block, else from ``end`` (where the loop stopped)."""
    s = copier.owner
    first_bad = end
    if pending:
        sums = block_checksums(copier, [job.block_ids[i] for i, _, _ in pending])
        for (i, key, want), got in zip(pending, sums, strict=True):
            if got != want:
                logger.warning(
                    "KV tier load of request %s: host block checksum mismatch; recomputing",
                    job.req_id,
                )
                s.counters["load_failures"] += 1
                with s.lock:
                    s.host.drop(key)
                first_bad = i
                break
            s.counters["host_loaded_bytes"] += s.host.block_bytes
            s.counters["host_hits"] += 1
    return list(job.block_ids[first_bad:])


def block_checksums(copier: TierCopier, block_ids: list[int]) -> list[int]:
    """The device checksums of the KV cache's ``block_ids``, computed on the tier stream
    after the copies queued there, gathered a chunk at a time."""
    kv = copier.owner.kv
    step = max(1, CHUNK_BYTES // kv.shape[1])
    out: list[int] = []
    with torch.cuda.stream(copier.stream):
        for i in range(0, len(block_ids), step):
            ids = torch.tensor(block_ids[i : i + step], device=kv.device)
            out += device_checksums(kv.index_select(0, ids)).tolist()
    return out
