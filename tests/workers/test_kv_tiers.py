"""KV tiers (kvtransfer/tiers/) in one engine: greedy fp32 tokens identical with the
tiers on and off while prefixes are evicted to host and disk and loaded back (chunked
prefill and preemption in the mix), multi-turn cached_tokens from host then disk,
restart, corrupted blocks, a full disk, an unwritable directory, late and aborted
loads. Every scenario ends with ``check_integrity()`` of the engine and every tier."""

from __future__ import annotations

import json
import os
import struct

import pytest

from tandem.kvtransfer.tiers.disk import header_bytes
from tandem.wire.engine_protocol import EngineRequest, SamplingParams
from tandem.workers.config import EngineConfig
from tandem.workers.engine.llm import LLM

pytestmark = pytest.mark.long  # tens of seconds: started early (tests/conftest.py)

SP = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
GIB = 1 << 30
FILE_HEADER = header_bytes(1)  # a segment's header page: budget one a block (sha256 keys)


def prompts_with_shared_prefixes(n: int = 6, length: int = 70, vocab: int = 200) -> list[list[int]]:
    out = []
    for i in range(n):
        p = [(i * 7 + j * 3) % vocab + 5 for j in range(length)]
        if i % 2:  # every other prompt continues its predecessor's first 3 blocks
            p[:48] = out[-1][:48]
        out.append(p)
    return out


def block_bytes(llm: LLM) -> int:
    kv = llm.engine.kv_cache
    return kv[0].numel() * kv.element_size()


def tiers(llm: LLM):
    return llm.engine.connector_worker.store


def settle(llm: LLM) -> None:
    assert tiers(llm).flush(30), "tier stores did not drain"
    llm.engine.check_integrity()


def flip_every_block(root, slots: set[int] | None = None) -> int:
    """Flip a byte in every block (or in the blocks at ``slots``) of every segment file
    under ``root``, the header pages left intact: the number of blocks flipped."""
    n = 0
    for f in sorted(root.rglob("*.kvs")):
        data = bytearray(f.read_bytes())
        count, bb, hlen = struct.unpack_from("<III", data, 8)  # segments.py's header
        stride = -(-bb // 4096) * 4096
        for slot in range(count):
            if slots is None or slot in slots:
                data[hlen + slot * stride + bb - 5] ^= 0xFF
                n += 1
        f.write_bytes(bytes(data))
    return n


def reference(model: str, prompts, **kw) -> list[list[int]]:
    with LLM(EngineConfig.from_flat(model=model, dtype="float32", num_kv_blocks=256, **kw)) as ref:
        out = [r.token_ids for r in ref.generate(prompt_token_ids=prompts, sampling_params=SP)]
        ref.engine.check_integrity()
    return out


def tiered(model: str, tmp_path, host_blocks: int, disk_blocks: int = 0, **kw) -> LLM:
    probe = LLM(EngineConfig.from_flat(model=model, dtype="float32", num_kv_blocks=4))
    bb = block_bytes(probe)
    probe.close()
    extra = {}
    if disk_blocks:
        extra = dict(
            kv_offloading_disk_dir=str(tmp_path / "kv"),
            kv_offloading_disk_size=(disk_blocks * (bb + FILE_HEADER)) / GIB,
        )
    cfg = dict(model=model, dtype="float32", **kw, **extra)
    if host_blocks:
        cfg["kv_offloading_size"] = host_blocks * bb / GIB
    return LLM(EngineConfig.from_flat(**cfg))


@pytest.mark.parametrize(
    "model,async_scheduling", [("tiny", False), ("tiny", True), ("smollm2", False)]
)
def test_tokens_identical_with_tiers_evicting_to_host_and_disk(model, async_scheduling, tmp_path):
    prompts = prompts_with_shared_prefixes()
    want = reference(model, prompts)
    # a device cache of 14 blocks, 3 sequences of 5 blocks, 32-token chunks: prefixes are
    # evicted between the rounds, requests preempt each other, prompts prefill in chunks
    llm = tiered(
        model,
        tmp_path,
        host_blocks=10,
        disk_blocks=64,
        num_kv_blocks=14,
        max_num_seqs=3,
        max_num_batched_tokens=32,
        async_scheduling=async_scheduling,
    )
    try:
        # three rounds at least; more (up to eight) until requests have preempted each other:
        # stores run off the step, so which prefixes a round finds below the device, and so
        # whether three sequences ever need more than 14 blocks at once, depends on timing
        for i in range(8):
            got = llm.generate(prompt_token_ids=prompts, sampling_params=SP)
            assert [r.token_ids for r in got] == want
            settle(llm)
            if i >= 2 and llm.engine.scheduler.num_preemptions > 0:
                break
        stats = tiers(llm).stats()
        assert stats["host_hits"] > 0 and stats["disk_hits"] > 0, stats
        assert stats.get("load_failures", 0) == 0
        assert llm.engine.scheduler.num_preemptions > 0
        assert llm.engine.scheduler.prefix_cache_hits > 0
        # one prompt at a time: its whole prefix comes back from the tiers
        for p, w in zip(prompts, want, strict=True):
            (r,) = llm.generate(prompt_token_ids=[p], sampling_params=SP)
            assert r.token_ids == w and r.num_cached_tokens == 64
            settle(llm)
    finally:
        llm.close()


def test_multi_turn_cached_tokens_from_host_then_disk(tmp_path):
    def conversation(llm: LLM) -> list[int]:
        turn, cached = list(range(10, 60)), []  # 50 tokens
        for t in range(3):
            (r,) = llm.generate(prompt_token_ids=[turn], sampling_params=SP)
            cached.append(r.num_cached_tokens)
            settle(llm)
            # other traffic pushes the conversation out of the small device cache
            llm.generate(prompt_token_ids=[[200 + t] * 60, [210 + t] * 60], sampling_params=SP)
            settle(llm)
            turn = turn + r.token_ids + [70 + t] * 20
        return cached

    with tiered("tiny", tmp_path, host_blocks=64, num_kv_blocks=10, max_num_seqs=2) as llm:
        cached = conversation(llm)
        assert cached[0] == 0 and cached[1] >= 48 and cached[2] >= 64, cached
        stats = tiers(llm).stats()
        assert stats["host_hits"] > 0 and "disk_hits" not in stats
        check_operator_views(llm)
    # host too small for the conversation: the earlier turns come back from disk
    with tiered(
        "tiny", tmp_path, host_blocks=2, disk_blocks=128, num_kv_blocks=10, max_num_seqs=2
    ) as llm:
        cached = conversation(llm)
        assert cached[0] == 0 and cached[1] >= 48 and cached[2] >= 64, cached
        assert tiers(llm).stats()["disk_hits"] > 0


def check_operator_views(llm: LLM) -> None:
    """The engine's stats as the gateway decodes them -> tandem:kv_offload_* and the
    /cluster/state row."""
    import msgspec

    from tandem.cluster.gateway.backend import EngineMetrics
    from tandem.cluster.observability.dashboard.state import _engine
    from tandem.cluster.observability.kv_offload_metrics import offload_families
    from tandem.scheduler.engine_stats import STATS_DECODER

    stats = STATS_DECODER.decode(msgspec.msgpack.encode(llm.engine.stats()))
    metrics = EngineMetrics(stats=stats)
    samples = {
        (s.name, s.labels.get("medium") or s.labels.get("reason")): s.value
        for family in offload_families([metrics])
        for s in family.samples
    }
    raw = tiers(llm).stats()
    assert samples[("tandem:kv_offload_hits_total", "host")] == raw["host_hits"]
    assert samples[("tandem:kv_offload_stored_bytes_total", "host")] == raw["host_stored_bytes"]
    assert samples[("tandem:kv_offload_used_bytes", "host")] == raw["host_used_bytes"]
    assert samples[("tandem:kv_offload_load_seconds_count", None)] > 0
    assert ("tandem:kv_offload_failures_total", "timeout") in samples
    assert samples[("tandem:kv_offload_store_queue_depth", None)] == 0
    (row,) = _engine(metrics).kv_tiers
    assert row.medium == "host" and row.used_bytes == raw["host_used_bytes"] and row.hits > 0


def test_tenants_stay_apart_in_the_tiers(tmp_path):
    prompt = list(range(20, 90))
    with tiered("tiny", tmp_path, host_blocks=32, disk_blocks=32, num_kv_blocks=6) as llm:
        (a,) = llm.generate(prompt_token_ids=[prompt], sampling_params=SP, cache_salt="a")
        settle(llm)
        llm.generate(prompt_token_ids=[[3] * 80], sampling_params=SP)  # evicts the device copy
        settle(llm)
        (b,) = llm.generate(prompt_token_ids=[prompt], sampling_params=SP, cache_salt="b")
        assert b.num_cached_tokens == 0 and b.token_ids == a.token_ids
        settle(llm)
        (a2,) = llm.generate(prompt_token_ids=[prompt], sampling_params=SP, cache_salt="a")
        assert a2.num_cached_tokens == 64 and a2.token_ids == a.token_ids
        settle(llm)


def test_disk_tier_survives_a_restart_and_checks_its_fingerprint(tmp_path):
    prompts = prompts_with_shared_prefixes(4)
    want = reference("tiny", prompts)
    kw = dict(host_blocks=0, disk_blocks=64, num_kv_blocks=32)
    with tiered("tiny", tmp_path, **kw) as llm:
        assert [
            r.token_ids for r in llm.generate(prompt_token_ids=prompts, sampling_params=SP)
        ] == want
        settle(llm)
        before = {k: (seg.name, slot) for k, (seg, slot) in tiers(llm).disk.index.items()}
        used = tiers(llm).disk.used_bytes
    with tiered("tiny", tmp_path, **kw) as llm:  # a fresh engine: empty device cache
        disk = tiers(llm).disk  # re-indexed from the segments' header pages
        assert disk.num_reindexed == len(before) > 0 and disk.used_bytes == used
        assert {k: (seg.name, slot) for k, (seg, slot) in disk.index.items()} == before
        got = llm.generate(prompt_token_ids=prompts, sampling_params=SP)
        assert [r.token_ids for r in got] == want
        assert all(r.num_cached_tokens == 64 for r in got)
        settle(llm)
    with pytest.raises(ValueError, match="--kv-offloading-disk-dir.*block_size"):
        tiered("tiny", tmp_path, block_size=32, **kw)
    (tmp_path / "kv" / "engine-0" / "fingerprint.json").write_text("{not json")
    with pytest.raises(ValueError, match="--kv-offloading-disk-dir.*unreadable"):
        tiered("tiny", tmp_path, **kw)


def test_corrupted_blocks_are_misses_never_wrong_tokens(tmp_path):
    prompts = prompts_with_shared_prefixes(4)
    want = reference("tiny", prompts)
    kw = dict(host_blocks=0, disk_blocks=64, num_kv_blocks=32)
    with tiered("tiny", tmp_path, **kw) as llm:
        llm.generate(prompt_token_ids=prompts, sampling_params=SP)
        settle(llm)
        bb = block_bytes(llm)
    flipped = flip_every_block(tmp_path / "kv")
    files = sorted((tmp_path / "kv").rglob("*.kvs"))
    assert files
    pad = -bb % 4096  # the bytes after a block up to its page's end
    os.truncate(files[0], files[0].stat().st_size - pad - 100)  # torn: its last block cut
    with tiered("tiny", tmp_path, **kw) as llm:
        got = llm.generate(prompt_token_ids=prompts, sampling_params=SP)
        assert [r.token_ids for r in got] == want
        settle(llm)
        stats = tiers(llm).stats()
        # the cut block was left out at re-index; flipped ones fail their checksum
        assert tiers(llm).disk.num_reindexed == flipped - 1
        assert stats["load_failures"] > 0 and stats.get("disk_hits", 0) == 0, stats
    # host tier: corrupt every stored slot; loads fail their checksum and recompute
    with tiered("tiny", tmp_path, host_blocks=64, num_kv_blocks=8) as llm:
        llm.generate(prompt_token_ids=prompts, sampling_params=SP)
        settle(llm)
        tiers(llm).host.data.bitwise_not_()
        got = llm.generate(prompt_token_ids=prompts, sampling_params=SP)
        assert [r.token_ids for r in got] == want
        assert all(r.num_cached_tokens <= 48 for r in got)
        settle(llm)
        assert tiers(llm).stats()["load_failures"] > 0


def test_a_corrupted_block_inside_a_segment_is_a_miss_while_its_neighbours_load(tmp_path):
    """One prompt's 4 full blocks are one segment. With its second block flipped, a
    fresh engine loads the first, recomputes from the second (same tokens) and stores
    that block again in a new segment; the next fresh engine re-indexes both segments
    (the newer copy wins over the hole) and loads all four: the blocks after the bad one
    stayed indexed."""
    prompt = prompts_with_shared_prefixes(1)
    want = reference("tiny", prompt)
    kw = dict(host_blocks=0, disk_blocks=64, num_kv_blocks=32)
    with tiered("tiny", tmp_path, **kw) as llm:
        llm.generate(prompt_token_ids=prompt, sampling_params=SP)
        settle(llm)
        assert len(tiers(llm).disk.segments) == 1
    assert flip_every_block(tmp_path / "kv", slots={1}) == 1
    with tiered("tiny", tmp_path, **kw) as llm:
        assert tiers(llm).disk.num_reindexed == 4
        (r,) = llm.generate(prompt_token_ids=prompt, sampling_params=SP)
        assert r.token_ids == want[0] and r.num_cached_tokens == 16
        settle(llm)
        stats = tiers(llm).stats()
        assert stats["load_failures"] == 1 and stats["disk_hits"] == 1, stats
        assert stats["disk_stored_blocks"] == 1 and len(tiers(llm).disk.segments) == 2
    with tiered("tiny", tmp_path, **kw) as llm:
        disk = tiers(llm).disk
        assert disk.num_reindexed == 4 and len(disk.segments) == 2
        (r,) = llm.generate(prompt_token_ids=prompt, sampling_params=SP)
        assert r.token_ids == want[0] and r.num_cached_tokens == 64
        settle(llm)
        stats = tiers(llm).stats()
        assert stats["disk_hits"] == 4 and stats.get("load_failures", 0) == 0, stats


def test_disk_full_stops_stores_and_service_goes_on(tmp_path, monkeypatch):
    import errno

    from tandem.kvtransfer.tiers.segments import SegmentWriter

    prompts = prompts_with_shared_prefixes(4)
    want = reference("tiny", prompts)
    with tiered("tiny", tmp_path, host_blocks=4, disk_blocks=64, num_kv_blocks=32) as llm:

        def full(writer, key, payload, check):  # a block's write into its segment
            raise OSError(errno.ENOSPC, "No space left on device", writer.tmp)

        monkeypatch.setattr(SegmentWriter, "add", full)
        for _ in range(2):
            got = llm.generate(prompt_token_ids=prompts, sampling_params=SP)
            assert [r.token_ids for r in got] == want
            settle(llm)
        stats = tiers(llm).stats()
        assert stats["disk_full"] == 1 and stats["disk_blocks"] == 0  # one warning, then off
        assert stats["host_stored_blocks"] > 0
        assert not list((tmp_path / "kv").rglob("*.tmp"))  # the segment begun is removed
        assert stats["disk_used_bytes"] == 0


def test_unwritable_disk_dir_is_a_start_up_error(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(ValueError, match="--kv-offloading-disk-dir"):
        LLM(
            EngineConfig.from_flat(
                model="tiny",
                kv_offloading_disk_dir=str(blocker / "kv"),
                kv_offloading_disk_size=0.01,
            )
        )


def test_tier_export_needs_a_nixl_connector(tmp_path):
    with tiered("tiny", tmp_path, host_blocks=8) as llm:
        with pytest.raises(ValueError, match="kv_connector nixl"):
            llm.engine.kv_tier_export([b"x" * 32])


@pytest.mark.parametrize("bad", ["unwritable", "another configuration", "format 1"])
def test_optional_disk_tier_warns_and_serves_host_only(bad, tmp_path, caplog):
    """``--kv-offloading-disk-optional``: an unusable disk directory is a warning, a
    ``disk_unusable`` failure, and service from the host tier alone."""
    prompts = prompts_with_shared_prefixes(4)
    want = reference("tiny", prompts)
    root = tmp_path / "kv"
    if bad == "unwritable":
        (tmp_path / "a-file").write_text("x")
        root = tmp_path / "a-file" / "kv"
    elif bad == "format 1":  # an older Tandem's directory: block files of format 1
        with tiered("tiny", tmp_path, host_blocks=0, disk_blocks=8):
            pass
        fp = root / "engine-0" / "fingerprint.json"
        fp.write_text(json.dumps(dict(json.loads(fp.read_text()), format=1), sort_keys=True))
    else:  # a disk tier of block size 32 was here
        with tiered("tiny", tmp_path, host_blocks=0, disk_blocks=8, block_size=32):
            pass
    kw = dict(kv_offloading_disk_optional=True, num_kv_blocks=12)
    with caplog.at_level("WARNING", logger="tandem.kvtransfer.tiers.store"):
        llm = LLM(
            EngineConfig.from_flat(
                model="tiny",
                dtype="float32",
                kv_offloading_size=0.001,
                kv_offloading_disk_dir=str(root),
                kv_offloading_disk_size=0.01,
                **kw,
            )
        )
    with llm:
        assert "--kv-offloading-disk-dir" in caplog.text and "host KV tier only" in caplog.text
        if bad == "format 1":
            assert "differs in format" in caplog.text
        store = tiers(llm)
        assert store.disk is None and store.host is not None
        got = llm.generate(prompt_token_ids=prompts, sampling_params=SP)
        assert [r.token_ids for r in got] == want
        settle(llm)
        report = store.report(0)
        assert [t.medium for t in report.tiers] == ["host"]
        assert report.failures_total["disk_unusable"] == 1
    with pytest.raises(ValueError, match="--kv-offloading-disk-optional needs"):
        LLM(EngineConfig.from_flat(model="tiny", kv_offloading_size=0.01, **kw))


def test_late_and_aborted_loads_recompute_and_leak_nothing(tmp_path):
    prompt = list(range(30, 100))
    want = reference("tiny", [prompt])[0]
    llm = tiered(
        "tiny",
        tmp_path,
        host_blocks=32,
        num_kv_blocks=6,
        extra={"kv_tiers": {"load_timeout_s": 0.0}},
    )
    try:
        llm.generate(prompt_token_ids=[prompt], sampling_params=SP)
        settle(llm)
        llm.generate(prompt_token_ids=[[4] * 80], sampling_params=SP)
        settle(llm)
        (r,) = llm.generate(prompt_token_ids=[prompt], sampling_params=SP)
        assert r.token_ids == want and r.num_cached_tokens == 0  # every load was late
        assert tiers(llm).stats()["load_timeouts"] > 0
        settle(llm)
        # abort a request while its load is queued
        llm.generate(prompt_token_ids=[[5] * 80], sampling_params=SP)
        settle(llm)
        engine = llm.engine
        assert engine.add_request(EngineRequest("abort-me", prompt, SP)) is None
        engine.step()
        assert "abort-me" in engine.scheduler.waiting_for_remote
        engine.abort(["abort-me"])
        for _ in range(1000):
            if not engine.has_work():
                break
            engine.step()
        settle(llm)
    finally:
        llm.close()


def test_reset_prefix_cache_empties_every_tier(tmp_path):
    """``reset_prefix_cache`` (the admin route benchmark clients call between runs) starts
    the next run cold in the tiers too: no device, host or disk hit, same tokens."""
    prompt = list(range(20, 90))
    with tiered("tiny", tmp_path, host_blocks=32, disk_blocks=32, num_kv_blocks=6) as llm:
        (first,) = llm.generate(prompt_token_ids=[prompt], sampling_params=SP)
        settle(llm)
        llm.generate(prompt_token_ids=[[3] * 80], sampling_params=SP)  # evicts the device copy
        settle(llm)
        (hit,) = llm.generate(prompt_token_ids=[prompt], sampling_params=SP)
        assert hit.num_cached_tokens == 64  # from the tiers
        settle(llm)
        store = tiers(llm)
        assert len(store.host.index) > 0 and len(store.disk.index) > 0
        assert llm.engine.reset_prefix_cache()
        assert len(store.host.index) == 0 and len(store.disk.index) == 0
        assert store.disk.used_bytes == 0
        assert not list((tmp_path / "kv").rglob("*.kvs"))  # the files are gone
        (cold,) = llm.generate(prompt_token_ids=[prompt], sampling_params=SP)
        assert cold.num_cached_tokens == 0 and cold.token_ids == first.token_ids
        settle(llm)


def test_tier_blocks_are_kv_events_naming_their_medium(tmp_path):
    """With routing on, every block a tier gains or loses is a KV event naming its
    medium ("host" / "disk"): a prefix index fed the engine's batches holds what each
    tier holds, a snapshot lists the tiers too, and a reset empties them there."""
    from tandem.cluster.routing.index import PrefixIndex

    prompt = list(range(20, 90))
    with tiered(
        "tiny", tmp_path, host_blocks=4, disk_blocks=32, num_kv_blocks=6, kv_events=True
    ) as llm:
        eng = llm.engine
        batches = []
        publish = eng.kv_publisher.publish
        eng.kv_publisher.publish = lambda b: (batches.append(b), publish(b))
        index = PrefixIndex()
        eid = eng.config.runtime.engine_id
        index.add_engine(eid, "colocated", 6)

        def synced() -> None:
            settle(llm)
            eng.publish_kv_events()
            for b in batches:
                assert index.apply(b)
            batches.clear()
            store = tiers(llm)
            assert index.hashes_of(eid, "host") == set(store.host.index)
            assert index.hashes_of(eid, "disk") == set(store.disk.index)
            assert index.hashes_of(eid) == set(eng.scheduler.kv.pool.cached)
            index.check_integrity()

        llm.generate(prompt_token_ids=[prompt], sampling_params=SP)
        synced()
        llm.generate(prompt_token_ids=[[3] * 80], sampling_params=SP)  # host evicts (4 slots)
        synced()
        assert index.hashes_of(eid, "host") and index.hashes_of(eid, "disk")
        assert tiers(llm).host.num_evictions > 0
        snap = eng.kv_events_snapshot()
        assert set(snap.tier_block_hashes["disk"]) == index.hashes_of(eid, "disk")
        assert eng.reset_prefix_cache()
        synced()
        assert not index.hashes_of(eid, "host") and not index.hashes_of(eid, "disk")
