"""The KV tiers' parts on their own (kvtransfer/tiers/): flag checks naming the flag,
the host tier's LRU and pins, the disk tier's accounting, re-index and file checks,
and the store's cancelled and dropped jobs."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from benchmarks.kv_disk_patterns import drop_page_cache
from tandem.kvtransfer.tiers.config import TierConfig, disk_name, fingerprint
from tandem.kvtransfer.tiers.disk import (
    DiskTier,
    TierLoadError,
    aligned_row,
    checksum,
    copy_bytes,
    header_bytes,
)
from tandem.kvtransfer.tiers.host import HostTier
from tandem.kvtransfer.tiers.store import LoadJob, StoreJob, TierStore
from tandem.workers.config import EngineConfig

BB = 64  # bytes per block in these tests


@pytest.mark.parametrize(
    "kw,flag",
    [
        (dict(kv_offloading_size=0), "--kv-offloading-size"),
        (dict(kv_offloading_size="1"), "--kv-offloading-size"),
        (
            dict(kv_offloading_disk_size=-2.0, kv_offloading_disk_dir="/x"),
            "--kv-offloading-disk-size",
        ),
        (dict(kv_offloading_disk_dir="/x"), "--kv-offloading-disk-size go together"),
        (dict(kv_offloading_disk_dir="", kv_offloading_disk_size=1), "--kv-offloading-disk-dir"),
        (dict(kv_offloading_size=1, enable_prefix_caching=False), "--no-prefix-caching"),
        (
            dict(kv_offloading_size=1, tensor_parallel_size=2, kv_connector="nixl"),
            "need kv_connector unset",
        ),
    ],
)
def test_bad_tier_flags_are_named(kw, flag):
    with pytest.raises(ValueError, match=flag):
        EngineConfig.from_flat(**kw)


def test_host_tier_lru_spares_pinned_keys():
    pinned: set[bytes] = set()
    host = HostTier(2, BB, False, lambda k: k in pinned)
    for key in (b"a", b"b"):
        host.commit(key, host.reserve(), 0)
    host.touch(b"a")  # b is now the least recently used
    pinned.add(b"b")
    slot = host.reserve()  # evicts a: b is pinned
    assert b"a" not in host and b"b" in host and host.num_evictions == 1
    host.check_integrity()
    pinned.add(b"x")
    host.commit(b"x", slot, 0)
    pinned.update((b"b", b"x"))
    assert host.reserve() is None  # everything pinned: the store is skipped
    host.drop(b"x")
    host.check_integrity()
    with pytest.raises(ValueError, match="--kv-offloading-size"):
        HostTier(0, BB, False, lambda k: False)


def _fp(**kw):
    return fingerprint(TierConfig(**kw), "float32", (2, 2, 16, 1, 1))


def _segment(disk: DiskTier, items: dict[bytes, np.ndarray]) -> str:
    """Write ``items`` as one segment the way the tier thread does: its name."""
    keys = list(items)
    name = disk.reserve(keys)
    assert name is not None
    writer = disk.writer(name, keys)
    for key, payload in items.items():
        assert disk.add(writer, key, payload, checksum(payload))
    disk.commit(name, writer, disk.finish(writer))
    disk.check_integrity()
    return name


def _blocks(*keys: bytes) -> dict[bytes, np.ndarray]:
    return {k: np.full(BB, k[-1], dtype=np.uint8) for k in keys}


def test_disk_segments_evict_whole_and_free_their_bytes(tmp_path):
    """A segment takes a header page and a page a block (BB < 4 KiB); the tier evicts
    the least recently used segment whole, and bytes on disk are what its files take:
    a block dropped alone leaves a hole, counted until its segment's last block goes."""
    seg_bytes = 3 * 4096  # header page + two blocks of a page each
    assert header_bytes(2, 2) == 4096
    disk = DiskTier(str(tmp_path), "e0", 2 * seg_bytes + 100, BB, _fp(), lambda k: False)
    first = _segment(disk, _blocks(b"a1", b"a2"))
    _segment(disk, _blocks(b"b1", b"b2"))
    disk.touch(b"a2")  # a is now the most recently used: b goes first
    _segment(disk, _blocks(b"c1", b"c2"))
    assert set(disk.index) == {b"a1", b"a2", b"c1", b"c2"} and disk.num_evictions == 2
    assert disk.used_bytes == 2 * seg_bytes
    assert sorted(os.listdir(disk.root / "segments"))[0] == first
    assert len(os.listdir(disk.root / "segments")) == 2  # b's file is gone
    seg, slot = disk.locate(b"c1")
    outs = [np.zeros(BB, dtype=np.uint8) for _ in range(2)]
    assert disk.read_piece(seg, slot, outs) == [True, True]
    assert (outs[0] == ord("1")).all() and (outs[1] == ord("2")).all()
    disk.drop(b"c1")  # a hole: the file stays, its bytes counted
    assert disk.used_bytes == 2 * seg_bytes and b"c2" in disk
    disk.check_integrity()
    disk.drop(b"c2")  # the segment's last block: its file goes, its bytes are free
    assert disk.used_bytes == seg_bytes and len(os.listdir(disk.root / "segments")) == 1
    disk.check_integrity()
    pinned = {b"a1"}
    small = DiskTier(str(tmp_path), "e0", seg_bytes + 100, BB, _fp(), lambda k: k in pinned)
    assert small.num_reindexed == 2
    assert small.reserve([b"d1", b"d2"]) is None  # the one segment holds a pinned block
    small.check_integrity()
    with pytest.raises(ValueError, match="--kv-offloading-disk-dir.*block_size"):
        DiskTier(str(tmp_path), "e0", 1 << 20, BB, _fp(block_size=32), lambda k: False)


def test_a_corrupted_block_inside_a_segment_is_a_miss_while_its_neighbours_load(tmp_path):
    """Each block keeps its own checksum: one flipped byte fails that block only. At
    re-index (header pages only) a file cut short keeps the blocks it still holds
    whole, and a segment whose header is damaged is removed."""
    disk = DiskTier(str(tmp_path), "e0", 1 << 20, BB, _fp(), lambda k: False)
    name = _segment(disk, _blocks(b"k1", b"k2", b"k3"))
    path = disk.path_of(name)
    data = bytearray(open(path, "rb").read())
    data[4096 + 4096 + 7] ^= 0xFF  # block 2 of 3
    open(path, "wb").write(bytes(data))
    seg, slot = disk.locate(b"k1")
    outs = [np.zeros(BB, dtype=np.uint8) for _ in range(3)]
    assert disk.read_piece(seg, slot, outs) == [True, False, True]
    assert (outs[0] == ord("1")).all() and (outs[2] == ord("3")).all()
    os.truncate(path, 4096 + 2 * 4096 + 10)  # cut inside block 3
    with pytest.raises(TierLoadError, match="cut short"):
        disk.read_piece(seg, slot, outs)
    again = DiskTier(str(tmp_path), "e0", 1 << 20, BB, _fp(), lambda k: False)
    assert again.num_reindexed == 2 and set(again.index) == {b"k1", b"k2"}
    assert again.used_bytes == os.path.getsize(path)
    again.check_integrity()
    data = bytearray(open(path, "rb").read())
    data[60] ^= 1  # inside the header's entries
    open(path, "wb").write(bytes(data))
    third = DiskTier(str(tmp_path), "e0", 1 << 20, BB, _fp(), lambda k: False)
    assert third.num_reindexed == 0 and not os.path.exists(path)
    third.check_integrity()


def test_a_tensor_parallel_rank_keeps_its_own_fingerprinted_directory(tmp_path):
    """TP=1 keeps ``<dir>/<engine id>`` and its fingerprint; rank r of TP=N keeps its
    own directory, and its fingerprint names N and r, so no other split reads it."""
    assert disk_name(TierConfig(engine_id="e0")) == "e0"
    assert disk_name(TierConfig(engine_id="e0", tp_size=2, tp_rank=1)) == "e0.tp2-rank1"
    assert "tp_size" not in _fp()
    disk = DiskTier(str(tmp_path), "e0", 1 << 20, BB, _fp(tp_size=2, tp_rank=1), lambda k: False)
    disk.check_integrity()
    for other in (_fp(), _fp(tp_size=2, tp_rank=0), _fp(tp_size=4, tp_rank=1)):
        with pytest.raises(ValueError, match="--kv-offloading-disk-dir.*tp_"):
            DiskTier(str(tmp_path), "e0", 1 << 20, BB, other, lambda k: False)


def test_read_file_stages_one_block_in_a_page_aligned_row(tmp_path):
    """The CUDA load path reads a disk block into a pinned, page-aligned row
    (``read_file``) and copies it on; the block's bytes are checked there too."""
    disk = DiskTier(str(tmp_path), "e0", 1 << 20, BB, _fp(), lambda k: False)
    payload = np.arange(BB, dtype=np.uint8)
    name = _segment(disk, {b"k1": payload, b"k2": payload[::-1].copy()})
    row = aligned_row(disk.row_bytes(b"k2"))
    block = disk.read_file(b"k2", row)
    assert (block == payload[::-1]).all() and block.ctypes.data == row.ctypes.data
    out = np.zeros(BB + 3, dtype=np.uint8)[3:]  # a destination at another offset
    disk.read(b"k1", out)
    assert (out == payload).all()
    data = bytearray(open(disk.path_of(name), "rb").read())
    data[2 * 4096 + 5] ^= 1
    open(disk.path_of(name), "wb").write(bytes(data))
    with pytest.raises(TierLoadError, match="checksum"):
        disk.read_file(b"k2", row)
    os.unlink(disk.path_of(name))
    with pytest.raises(TierLoadError, match="unreadable"):
        disk.read(b"k1", out)


@pytest.mark.parametrize("offset", [0, 1, 8, 56])
def test_copy_bytes_copies_at_any_offset(offset):
    src = np.random.default_rng(offset).integers(0, 255, 4096 + 61, dtype=np.uint8)
    for n in (4096, 4096 + 61):  # a multiple of 8 and not
        dst = np.zeros(n + offset, dtype=np.uint8)
        copy_bytes(dst[offset:], src[:n])
        assert (dst[offset:] == src[:n]).all() and not dst[:offset].any()


def _store(tmp_path, **kw) -> TierStore:
    store = TierStore(TierConfig(host_bytes=8 * 256, engine_id="u", **kw))
    store.open(torch.ones(8, 1, 2, 4, 2, 4), (0, 1, 2, 3, 4, 5))  # 256-byte blocks
    return store


def test_store_jobs_cancelled_or_over_the_queue_are_not_stored(tmp_path):
    store = _store(tmp_path, max_store_queue=2)
    try:
        cancelled = StoreJob(0, b"c")
        cancelled.cancelled = True  # the device block was reused before the copy
        store.submit_stores([cancelled, StoreJob(1, b"d"), StoreJob(2, b"e")])
        assert store.flush(10)
        stats = store.stats()
        assert stats["store_dropped"] == 1 and stats["host_blocks"] == 1
        assert b"d" in store.host and b"c" not in store.host
        store.check_integrity()
        # published at one schedule, evicted at the next before the step's stores are
        # queued (the overlapped loop): the eviction still voids the store
        late = StoreJob(3, b"late")
        assert store.register(late)
        assert not store.register(StoreJob(4, b"late"))  # one pending store per key
        store.cancel(b"late")
        store.submit_stores([late])
        assert store.flush(10)
        assert b"late" not in store.host and store.stats()["store_cancelled"] == 2
        assert not store.pending
        # a load of a key no tier holds reports every block bad and unpins it
        store.pin([b"d", b"zz"])
        store.submit_load(LoadJob("r", [b"d", b"zz"], [5, 6], 1e18))
        assert store.flush(10)
        assert store.poll() == [("r", [6])]
        store.check_integrity()
    finally:
        store.close()


def test_a_load_that_raises_still_reports_and_unpins(tmp_path):
    store = _store(tmp_path)
    try:
        store.submit_stores([StoreJob(1, b"k")])
        assert store.flush(10)

        def broken(job):
            raise RuntimeError("a bug in a load")

        store.copier.load_blocks = broken
        store.pin([b"k"])
        store.submit_load(LoadJob("r", [b"k"], [4], 1e18))
        assert store.flush(10)
        assert store.poll() == [("r", [4])]  # recomputed, never left waiting
        assert store.stats()["failures"] == 1
        store.check_integrity()
    finally:
        store.close()


def test_host_loads_are_byte_exact_and_a_flipped_byte_is_a_miss(tmp_path):
    """The host tier checks each block on the bytes just copied into the device block
    (copies.py, ``load_host``): a good load is byte-exact, a slot with one byte flipped
    fails the check, is dropped, and it and the rest of its run are reported bad."""
    store = TierStore(TierConfig(host_bytes=8 * 256, engine_id="u"))
    kv = torch.arange(8 * 64, dtype=torch.float32).reshape(8, 1, 2, 4, 2, 4)
    store.open(kv, (0, 1, 2, 3, 4, 5))  # 256-byte blocks
    try:
        want = kv.reshape(8, -1).clone()
        store.submit_stores([StoreJob(i, bytes([i])) for i in range(3)])
        assert store.flush(10)
        entries = [store.host.index[bytes([i])] for i in range(3)]
        for i, entry in enumerate(entries):
            assert checksum(store.host.data[entry.slot].numpy()) == entry.checksum
            assert torch.equal(store.host.data[entry.slot], want[i].view(torch.uint8))
        kv.zero_()
        keys = [bytes([i]) for i in range(3)]
        store.pin(keys)
        store.submit_load(LoadJob("good", keys, [5, 6, 7], 1e18))
        assert store.flush(10) and store.poll() == [("good", [])]
        assert torch.equal(kv.reshape(8, -1)[5:8], want[:3])
        store.host.data[entries[1].slot][17] ^= 1
        store.pin(keys)
        store.submit_load(LoadJob("bad", keys, [5, 6, 7], 1e18))
        assert store.flush(10) and store.poll() == [("bad", [6, 7])]
        assert keys[1] not in store.host and keys[0] in store.host and keys[2] in store.host
        stats = store.stats()
        assert stats["load_failures"] == 1 and stats["host_hits"] == 4
        assert stats["host_loaded_bytes"] == 4 * 256
        store.check_integrity()
    finally:
        store.close()


def test_a_format_2_directory_is_another_configuration(tmp_path):
    """Format 3 keeps blocks in segment files: a directory written by format 2 (one
    file a block; its fingerprint says so) is a start-up error naming the flag (or,
    with --kv-offloading-disk-optional, host-only service: tests/workers/test_kv_tiers.py)."""
    assert _fp()["format"] == 3
    root = tmp_path / "e0"
    (root / "blocks" / "6b").mkdir(parents=True)
    (root / "fingerprint.json").write_text(json.dumps(dict(_fp(), format=2), sort_keys=True))
    with pytest.raises(ValueError, match=r"--kv-offloading-disk-dir.*differs in format: \[2\]"):
        DiskTier(str(tmp_path), "e0", 1 << 20, BB, _fp(), lambda k: False)


def test_a_load_announces_the_next_queued_loads_disk_files(tmp_path):
    """Read-ahead (copies.py, ``locate``) where blocks are read buffered (a file system
    without O_DIRECT): a load announces its own disk blocks and those of the load
    queued behind it; the next load then skips what was announced for it. With
    O_DIRECT nothing is announced (the kernel's read-ahead would read them twice)."""
    store = TierStore(
        TierConfig(disk_dir=str(tmp_path), disk_bytes=1 << 20, engine_id="u", disk_readers=1)
    )
    kv = torch.arange(8 * 64, dtype=torch.float32).reshape(8, 1, 2, 4, 2, 4)
    store.open(kv, (0, 1, 2, 3, 4, 5))  # 256-byte blocks
    try:
        want = kv.reshape(8, -1).clone()
        keys = [bytes([i]) * 4 for i in range(4)]
        store.submit_stores([StoreJob(i, k) for i, k in enumerate(keys)])
        assert store.flush(10)
        announced: list[list[bytes]] = []
        store.disk.prefetch = announced.append
        assert store.disk.reader.direct  # /tmp takes O_DIRECT
        assert store.copier.load_blocks(LoadJob("d", keys[:2], [4, 5], 1e18)) == []
        assert announced == []
        store.disk.reader.direct = False
        first = LoadJob("a", keys[:2], [4, 5], 1e18)
        second = LoadJob("b", keys[2:], [6, 7], 1e18)
        store.next_load = lambda: second  # queued behind the first
        kv.zero_()
        assert store.copier.load_blocks(first) == []
        store.next_load = lambda: None
        assert store.copier.load_blocks(second) == []
        assert announced == [keys[:2] + keys[2:]]  # the second load's were announced
        assert torch.equal(kv.reshape(8, -1)[4:8], want[:4])
        store.check_integrity()
    finally:
        store.close()


@pytest.mark.parametrize("readers", [1, 4])
def test_a_run_in_one_segment_loads_with_one_read_and_a_bad_block_ends_it(tmp_path, readers):
    """The tier thread writes the blocks queued together as one segment; a load of a run
    of them is one ``read_piece`` (one ``preadv``) with one reader, byte-exact; with a
    block flipped on disk its predecessors load and it and the rest are recomputed,
    while the blocks after it stay indexed for the next load."""
    store = TierStore(
        TierConfig(disk_dir=str(tmp_path), disk_bytes=1 << 20, engine_id="u", disk_readers=readers)
    )
    kv = torch.arange(16 * 64, dtype=torch.float32).reshape(16, 1, 2, 4, 2, 4)
    store.open(kv, (0, 1, 2, 3, 4, 5))  # 256-byte blocks
    try:
        want = kv.reshape(16, -1).clone()
        keys = [bytes([i]) * 8 for i in range(8)]
        store.submit_stores([StoreJob(i, k) for i, k in enumerate(keys)])
        assert store.flush(10)
        disk = store.disk
        assert len(disk.segments) == 1 and store.stats()["disk_segments"] == 1
        reads: list[int] = []
        read_piece = disk.read_piece
        disk.read_piece = lambda seg, first, outs: (
            reads.append(len(outs)) or read_piece(seg, first, outs)
        )
        kv.zero_()
        store.pin(keys)
        store.submit_load(LoadJob("all", keys, list(range(8, 16)), 1e18))
        assert store.flush(10) and store.poll() == [("all", [])]
        assert torch.equal(kv.reshape(16, -1)[8:16], want[:8])
        assert reads == [8]  # 8 blocks: one piece (four readers cut pieces of 8 or more)
        (seg,) = disk.segments.values()
        with open(disk.path(seg), "r+b") as f:
            f.seek(seg.offset(5, disk.block_bytes) + 3)
            f.write(b"\xff\xfe")
        kv.zero_()
        store.pin(keys)
        store.submit_load(LoadJob("bad", keys, list(range(8, 16)), 1e18))
        assert store.flush(10) and store.poll() == [("bad", list(range(13, 16)))]
        assert torch.equal(kv.reshape(16, -1)[8:13], want[:5])
        assert keys[5] not in disk and all(k in disk for k in keys[6:])
        assert store.stats()["load_failures"] == 1 and store.stats()["disk_hits"] == 13
        store.check_integrity()
    finally:
        store.close()


def test_runs_spread_over_segments_take_one_read_per_piece(tmp_path):
    """Two store batches: two segments; a load spanning both reads two pieces. With
    four readers a long run is cut so every reader has a piece (disk_loads.plan)."""
    from tandem.kvtransfer.tiers import disk_loads

    store = TierStore(
        TierConfig(disk_dir=str(tmp_path), disk_bytes=1 << 20, engine_id="u", disk_readers=1)
    )
    kv = torch.arange(16 * 64, dtype=torch.float32).reshape(16, 1, 2, 4, 2, 4)
    store.open(kv, (0, 1, 2, 3, 4, 5))
    try:
        want = kv.reshape(16, -1).clone()
        keys = [bytes([i]) * 8 for i in range(6)]
        for part in (range(0, 3), range(3, 6)):
            store.submit_stores([StoreJob(i, keys[i]) for i in part])
            assert store.flush(10)
        assert len(store.disk.segments) == 2
        where = [store.disk.locate(k) for k in keys]
        pieces, _ = disk_loads.plan(where, 1)
        assert [(p.start, p.count) for p in pieces] == [(0, 3), (3, 3)]
        long_run = [(where[0][0], i) for i in range(40)]
        assert [p.count for p in disk_loads.plan(long_run, 4)[0]] == [10, 10, 10, 10]
        assert [p.count for p in disk_loads.plan(long_run[:12], 4)[0]] == [8, 4]
        kv.zero_()
        store.pin(keys)
        store.submit_load(LoadJob("r", keys, list(range(10, 16)), 1e18))
        assert store.flush(10) and store.poll() == [("r", [])]
        assert torch.equal(kv.reshape(16, -1)[10:16], want[:6])
        store.check_integrity()
    finally:
        store.close()


@pytest.mark.parametrize("bb,aligned", [(BB, False), (4096, True), (4096, False)])
def test_cold_blocks_come_by_o_direct_and_cached_ones_from_the_page_cache(tmp_path, bb, aligned):
    """segment_reads.py: blocks the page cache holds are read straight in; the rest by
    one O_DIRECT read (staged, or straight into page-aligned blocks of whole pages);
    a file system without O_DIRECT reads buffered. Bytes and checks are the same."""
    disk = DiskTier(str(tmp_path), "e0", 1 << 22, bb, _fp(), lambda k: False)
    rng = np.random.default_rng(bb)
    items = {bytes([i]) * 4: rng.integers(0, 255, bb, dtype=np.uint8) for i in range(6)}
    name = _segment(disk, items)
    seg, _ = disk.locate(next(iter(items)))
    rows = aligned_row(6 * bb + 64)[0 if aligned else 64 :][: 6 * bb].reshape(6, bb)
    want = list(items.values())
    seen: list[str] = []
    direct, cached = disk.reader._direct, disk.reader._cached
    disk.reader._direct = lambda *a: seen.append("direct") or direct(*a)

    def spy(*a):
        n = cached(*a)
        seen.append(f"cached {n}")
        return n

    disk.reader._cached = spy
    for state in ("cold", "first cached", "warm", "buffered"):
        rows[:] = 0
        drop_page_cache(disk.path_of(name))
        if state == "first cached":
            fd = os.open(disk.path_of(name), os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no read-ahead
            os.pread(fd, bb, seg.offset(0, bb))  # only block 0's page
            os.close(fd)
        elif state == "warm":
            open(disk.path_of(name), "rb").read()
        elif state == "buffered":
            disk.reader.direct = False
        seen.clear()
        assert disk.read_piece(seg, 0, list(rows)) == [True] * 6, state
        assert all((r == w).all() for r, w in zip(rows, want, strict=True)), state
        if state == "warm":
            assert seen == ["cached 6"]
        elif state == "first cached":
            assert seen == ["cached 1", "direct"]
        elif state == "cold":
            assert seen == ["cached 0", "direct"]
    assert not disk.reader.direct


def test_file_block_reads_one_cold_block_of_a_segment_for_the_cuda_path(tmp_path):
    """``TierCopier.file_block`` (what device_copies.py's CUDA loads call): one block of
    a segment read into the copier's page-aligned row and checked; here on CPU, cold."""
    store = TierStore(TierConfig(disk_dir=str(tmp_path), disk_bytes=1 << 22, engine_id="u"))
    kv = torch.arange(4 * 1024, dtype=torch.float32).reshape(4, 1, 2, 16, 2, 16)  # 4 KiB
    store.open(kv, (0, 1, 2, 3, 4, 5))
    try:
        want = kv.reshape(4, -1).view(torch.uint8).clone()
        keys = [bytes([i]) * 8 for i in range(3)]
        store.submit_stores([StoreJob(i, k) for i, k in enumerate(keys)])
        assert store.flush(10)
        (seg,) = store.disk.segments.values()
        drop_page_cache(store.disk.path(seg))
        for i in (2, 0):
            block = store.copier.file_block(keys[i])
            assert torch.equal(block, want[i]) and block.data_ptr() % 4096 == 0
        store.check_integrity()
    finally:
        store.close()
