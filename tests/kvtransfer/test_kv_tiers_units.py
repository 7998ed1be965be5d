"""The KV tiers' parts on their own (kvtransfer/tiers/): flag checks naming the flag,
the host tier's LRU and pins, the disk tier's accounting, re-index and file checks,
and the store's cancelled and dropped jobs."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tandem.kvtransfer.tiers.config import TierConfig, disk_name, fingerprint
from tandem.kvtransfer.tiers.disk import (
    DiskTier,
    TierLoadError,
    aligned_row,
    checksum,
    copy_bytes,
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


def test_disk_tier_accounting_reindex_and_file_checks(tmp_path):
    size = 4096 + BB  # the header page (header, key, zeros) + payload
    disk = DiskTier(str(tmp_path), "e0", 2 * size, BB, _fp(), lambda k: False)
    data = {k: np.full(BB, i, dtype=np.uint8) for i, k in enumerate((b"k1", b"k2", b"k3"))}
    for key, payload in data.items():
        assert disk.reserve(key)
        disk.write(key, payload, checksum(payload))
        disk.commit(key, True)
        disk.check_integrity()
    assert list(disk.index) == [b"k2", b"k3"] and disk.num_evictions == 1  # k1 evicted
    out = np.empty(BB, dtype=np.uint8)
    disk.read(b"k3", out)
    assert (out == 2).all()
    disk.path(b"k3").rename(disk.path(b"k1"))  # a file under another block's name
    with pytest.raises(TierLoadError, match="another block"):
        disk.read(b"k1", out)
    again = DiskTier(str(tmp_path), "e0", 2 * size, BB, _fp(), lambda k: False)
    assert again.num_reindexed == 2 and set(again.index) == {b"k1", b"k2"}
    again.check_integrity()
    with pytest.raises(ValueError, match="--kv-offloading-disk-dir.*block_size"):
        DiskTier(str(tmp_path), "e0", 2 * size, BB, _fp(block_size=32), lambda k: False)


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


def test_disk_reads_stage_the_whole_file_and_still_catch_every_bad_file(tmp_path):
    """Format 2: the block starts on the file's second page. ``read_file`` reads a
    block's file whole into a page-aligned row and returns the checked block as a
    page-aligned view of it; ``read`` reads the block straight into its destination. A
    file cut short, one byte longer, flipped in the block, or not ours is a
    TierLoadError either way."""
    size = 4096 + BB  # the header page, the block
    disk = DiskTier(str(tmp_path), "e0", 8 * size, BB, _fp(), lambda k: False)
    payload = np.arange(BB, dtype=np.uint8)
    for key in (b"k1", b"k2"):
        assert disk.reserve(key)
        disk.write(key, payload, checksum(payload))
        disk.commit(key, True)
    row = aligned_row(disk.row_bytes(b"k1"))
    assert row.ctypes.data % 4096 == 0 and row.nbytes == size + 1
    block = disk.read_file(b"k1", row)
    assert (block == payload).all() and block.ctypes.data == row.ctypes.data + 4096
    assert disk.path(b"k1").read_bytes()[4096:] == payload.tobytes()
    out = np.zeros(BB + 3, dtype=np.uint8)[3:]  # a destination at another offset
    disk.read(b"k1", out)
    assert (out == payload).all()
    good = disk.path(b"k2").read_bytes()
    for bad, match in (
        (good[:-1], "wrong size"),
        (good + b"x", "wrong size"),
        (good[:-1] + bytes([good[-1] ^ 1]), "checksum"),
        (b"XKVB" + good[4:], "not ours"),
    ):
        disk.path(b"k2").write_bytes(bad)
        with pytest.raises(TierLoadError, match=match):
            disk.read(b"k2", out)
        with pytest.raises(TierLoadError, match=match):
            disk.read_file(b"k2", row)
    disk.path(b"k2").unlink()
    with pytest.raises(TierLoadError, match="unreadable"):
        disk.read(b"k2", out)


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


def test_a_format_1_directory_is_another_configuration(tmp_path):
    """Format 2 moved the block to the file's second page: a directory written by
    format 1 (its fingerprint says so) is a start-up error naming the flag (or, with
    --kv-offloading-disk-optional, host-only service: tests/workers/test_kv_tiers.py),
    and a block file of the old layout is dropped at re-index (its size differs)."""
    old = dict(_fp(), format=1)
    root = tmp_path / "e0"
    (root / "blocks" / "6b").mkdir(parents=True)
    (root / "fingerprint.json").write_text(json.dumps(old, sort_keys=True))
    with pytest.raises(ValueError, match=r"--kv-offloading-disk-dir.*differs in format: \[1\]"):
        DiskTier(str(tmp_path), "e0", 1 << 20, BB, _fp(), lambda k: False)
    (root / "fingerprint.json").unlink()
    old_file = root / "blocks" / "6b" / (b"k1".hex() + ".kvb")
    old_file.write_bytes(bytes(24 + 2 + BB))  # format 1: header, key, block
    disk = DiskTier(str(tmp_path), "e0", 1 << 20, BB, _fp(), lambda k: False)
    assert disk.num_reindexed == 0 and not old_file.exists()
    disk.check_integrity()


def test_a_load_announces_the_next_queued_loads_disk_files(tmp_path):
    """Read-ahead (copies.py, ``locate``): a load announces its own disk files and those
    of the load queued behind it; the next load then skips what was announced for it."""
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
