"""benchmarks/kv_tiers.py's copy part: store and load GB/s of each KV tier through
``TierStore`` (the tier thread, checksums included) next to its ceiling.

Host (CPU): each round measures, back to back in the same seconds (the box's load drifts),
  - ``copy_ all``: one torch ``copy_`` of every block at once (torch's threads, two here);
  - ``1 thread``: one thread copying block by block (numpy), as the tier thread does;
  - ``2 threads``: two threads block by block, half the blocks each (would a second core
    help a load?);
  - ``copy, xxh3``: one thread copying block by block and taking each block's xxh3-64
    right after its copy, from the core's cache: the least a checked copy costs (no
    queue, no index, no lock); ``xxh3, copy``: the checksum of the source first, from
    DRAM (the order the tier's loads used before session 10);
  - the tier: every block stored (the tier full, each store evicting), then loaded.
  The ratios are each round's load over that round's ceiling, the median over rounds.
  On a shared box the same ratio is also given in thread CPU time (the tier thread's
  against the copying thread's), which time spent waiting for a core does not count.
Host (CUDA): the ceiling is PCIe, one pinned->device ``copy_`` of it all.
Disk: each round loads the blocks from cold segment files (their pages dropped), again
  with the files read into the page cache (the tier's own cost), then reads one file of
  the same bytes sequentially, cold (the ceiling). The KV cache is page-aligned, as the
  engine allocates it on CPU, so cold blocks land by O_DIRECT straight in.
"""

from __future__ import annotations

import statistics
import threading
import time
from pathlib import Path

import torch
import xxhash

from benchmarks.kv_disk_patterns import drop_page_cache
from tandem.kvtransfer.tiers.config import TierConfig
from tandem.kvtransfer.tiers.store import LoadJob, StoreJob, TierStore
from tandem.workers.runner.kv_cache import page_aligned_zeros


def _load_all(store: TierStore, keys: list[bytes], num_blocks: int) -> float:
    store.pin(keys)
    start = time.perf_counter()
    step = 64
    for i in range(0, len(keys), step):
        part = keys[i : i + step]
        store.submit_load(
            LoadJob(f"r{i}", part, [j % num_blocks for j in range(i, i + len(part))], 1e18)
        )
    done = 0
    while done < len(range(0, len(keys), step)):
        done += len(store.poll())
        time.sleep(0.0005)
    return time.perf_counter() - start


def _pcie(src: torch.Tensor) -> tuple[float, float]:
    """GB/s of one device->pinned and one pinned->device copy of ``src`` (CUDA)."""
    host = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
    out = []
    for dst, frm in ((host, src), (src, host)):
        dst.copy_(frm)
        torch.cuda.synchronize()
        t = time.perf_counter()
        dst.copy_(frm)
        torch.cuda.synchronize()
        out.append(src.numel() / (time.perf_counter() - t) / 1e9)
    return out[0], out[1]


def _seq_read_gbs(src: torch.Tensor, tmp: str) -> float:
    """A cold sequential read of one file of ``src``'s bytes (1 MiB reads)."""
    big = Path(tmp) / "seq.bin"
    with open(big, "wb") as f:
        f.write(memoryview(src.numpy()))
    drop_page_cache(big)
    buf = bytearray(1 << 20)
    t = time.perf_counter()
    with open(big, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass
    gbs = src.numel() / (time.perf_counter() - t) / 1e9
    big.unlink()
    return gbs


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def cpu_ceilings(src: torch.Tensor, dst: torch.Tensor) -> dict[str, float]:
    """Seconds of each plain copy of ``src`` into ``dst`` (see the module's doc)."""
    srcn, dstn = src.numpy(), dst.numpy()
    n = len(srcn)

    def rows(lo: int, hi: int, check: str = "") -> None:
        for i in range(lo, hi):
            if check == "before":
                xxhash.xxh3_64_intdigest(srcn[i])
            dstn[i] = srcn[i]
            if check == "after":
                xxhash.xxh3_64_intdigest(dstn[i])

    def two() -> None:
        threads = [threading.Thread(target=rows, args=a) for a in ((0, n // 2), (n // 2, n))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    cpu = time.thread_time()
    out = {"1 thread": _timed(lambda: rows(0, n))}
    out["cpu: 1 thread"] = time.thread_time() - cpu
    out["copy, xxh3"] = _timed(lambda: rows(0, n, "after"))
    out["xxh3, copy"] = _timed(lambda: rows(0, n, "before"))
    out["2 threads"] = _timed(two)
    # last: torch's worker threads spin a while after a parallel copy_, taking the
    # core a one-thread copy measured right after it would want
    out["copy_ all"] = _timed(lambda: dst.copy_(src))
    return out


def _open(kv: torch.Tensor, cfg: TierConfig, keys: list[bytes]) -> TierStore:
    store = TierStore(cfg)
    store.open(kv, (0, 1, 2, 3, 4, 5))
    # steady state: the tier is full (its pages touched) and every store evicts
    store.submit_stores([StoreJob(i, b"w" + k) for i, k in enumerate(keys)])
    assert store.flush(300)
    return store


def _store_all(store: TierStore, keys: list[bytes], salt: bytes) -> float:
    t = time.perf_counter()
    store.submit_stores([StoreJob(i, salt + k) for i, k in enumerate(keys)])
    assert store.flush(300)
    return time.perf_counter() - t


def host_rounds(kv: torch.Tensor, keys: list[bytes], repeats: int, device: str) -> dict:
    """Median GB/s of the host tier's stores and loads and of each ceiling, and the
    median of each round's load / ceiling."""
    num_blocks = kv.shape[0]
    src = kv.reshape(num_blocks, -1).view(torch.uint8)
    total = src.numel()
    cfg = TierConfig(host_bytes=total, engine_id="bench-host", max_store_queue=num_blocks)
    store = _open(kv, cfg, keys)
    dst = torch.empty_like(src) if device == "cpu" else None
    if dst is not None:
        dst.copy_(src)  # its pages touched
    runs: list[dict[str, float]] = []
    try:
        for r in range(repeats):
            if dst is not None:
                gbs = {k: total / s / 1e9 for k, s in cpu_ceilings(src, dst).items()}
            else:
                d2h, h2d = _pcie(src)
                gbs = {"PCIe": h2d, "PCIe device->pinned": d2h}
            salt = r.to_bytes(2, "little")  # new keys: every store copies and evicts
            gbs["store"] = total / _store_all(store, keys, salt) / 1e9
            loaded = [salt + k for k in keys]
            clock = time.pthread_getcpuclockid(store._thread.ident)  # the tier thread's
            cpu = time.clock_gettime(clock)
            gbs["load"] = total / _load_all(store, loaded, num_blocks) / 1e9
            gbs["cpu: load"] = total / (time.clock_gettime(clock) - cpu) / 1e9
            runs.append(gbs)
        store.check_integrity()
    finally:
        store.close()
    out = {k: statistics.median(g[k] for g in runs) for k in runs[0]}
    for k in runs[0]:
        if k not in ("store", "load") and not k.startswith("cpu"):
            out[f"load / {k}"] = statistics.median(g["load"] / g[k] for g in runs)
    if "cpu: 1 thread" in out:
        out["cpu: ratio"] = statistics.median(g["cpu: load"] / g["cpu: 1 thread"] for g in runs)
    return out


def disk_row(
    kv: torch.Tensor, keys: list[bytes], tmp: str, readers: int, repeats: int
) -> tuple[float, float, float, float, float]:
    """(store, cold load, warm load, ceiling, median of load / ceiling), GB/s."""
    num_blocks = kv.shape[0]
    src = kv.reshape(num_blocks, -1).view(torch.uint8)
    total = src.numel()
    cfg = TierConfig(
        disk_readers=readers,
        disk_dir=tmp,
        disk_bytes=2 * total,
        engine_id=f"bench-disk-{readers}",  # each row starts empty
        max_store_queue=num_blocks,
    )
    store = _open(kv, cfg, keys)
    loads, warms, ceilings = [], [], []
    try:
        store_gbs = total / _store_all(store, keys, b"") / 1e9
        for _ in range(repeats):
            for p in store.disk.root.rglob("*.kvs"):
                drop_page_cache(p)
            loads.append(total / _load_all(store, keys, num_blocks) / 1e9)
            # the same loads again, the files now in the page cache (read into it
            # first: the cold loads read with O_DIRECT, past it): the tier's own cost
            # (system calls, checksums, the copies) without the device's
            for p in store.disk.root.rglob("*.kvs"):
                p.read_bytes()
            warms.append(total / _load_all(store, keys, num_blocks) / 1e9)
            # the disk's ceiling right after the loads (the box's load drifts)
            ceilings.append(_seq_read_gbs(src, tmp))
        store.check_integrity()
    finally:
        store.close()
    ratio = statistics.median(a / b for a, b in zip(loads, ceilings, strict=True))
    med = statistics.median
    return store_gbs, med(loads), med(warms), med(ceilings), ratio


def copy_part(
    num_blocks: int, block_bytes: int, tmp: str, device: str, readers: tuple, repeats: int
) -> None:
    """Print both tables."""
    layers = block_bytes // (2 * 16 * 8 * 64 * 2)
    kv = torch.randn(num_blocks, layers, 2, 16, 8, 64).to(torch.bfloat16).to(device)
    if device == "cpu":  # page-aligned, as the engine allocates it (workers/runner/kv_cache.py)
        kv = page_aligned_zeros(list(kv.shape), kv.dtype).copy_(kv)
    keys = [i.to_bytes(4, "little") * 8 for i in range(num_blocks)]
    kib = block_bytes // 1024
    print(f"\n1. copies of {num_blocks} blocks of {kib} KiB on {device} (GB/s)")
    host = host_rounds(kv, keys, max(repeats, 1), device)
    ceilings = [
        k for k in host if k not in ("store", "load") and not k.startswith(("load /", "cpu"))
    ]
    print(f"host tier, medians of {max(repeats, 1)} rounds:")
    print("| store | load | " + " | ".join(f"ceiling: {k}" for k in ceilings) + " | "
          + " | ".join(f"load / {k}" for k in ceilings) + " |")  # fmt: skip
    print("| --- " * (2 + 2 * len(ceilings)) + "|")
    print(f"| {host['store']:.2f} | {host['load']:.2f} | "
          + " | ".join(f"{host[k]:.2f}" for k in ceilings) + " | "
          + " | ".join(f"{host['load / ' + k]:.2f}" for k in ceilings) + " |")  # fmt: skip
    if "cpu: ratio" in host:
        print(f"per CPU-second (thread CPU time: what another process's use of the cores "
              f"does not count): the tier thread loads {host['cpu: load']:.2f} GB, one "
              f"thread copies {host['cpu: 1 thread']:.2f} GB block by block; "
              f"load / 1 thread {host['cpu: ratio']:.2f}")  # fmt: skip
    if device != "cpu" or not readers:
        return
    print(f"disk tier, medians of {repeats} rounds (ceiling: one file read sequentially, cold)")
    print("| readers | store | load, cold | load, files in the page cache | ceiling | "
          "load / ceiling |\n| --- | --- | --- | --- | --- | --- |")  # fmt: skip
    for n in readers:
        store_gbs, load, warm, ceiling, ratio = disk_row(kv.cpu(), keys, tmp, n, repeats)
        print(f"| {n} | {store_gbs:.2f} | {load:.2f} | {warm:.2f} | {ceiling:.2f} | {ratio:.2f} |")
