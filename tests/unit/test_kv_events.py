"""KV events (scheduler/kv_events.py) against the cluster prefix index
(cluster/routing/index.py): the index equals the engine's cache."""

import random

import pytest

from tandem.cluster.routing.index import PrefixIndex
from tandem.scheduler.kv_events import BlockRemoved, BlockStored, KVEventBatch
from tests.unit.kv_sim import SimEngine


def _feed(index: PrefixIndex, engine: SimEngine) -> None:
    for batch in engine.take_batches():
        assert index.apply(batch), f"unexpected gap at seq {batch.seq}"


@pytest.mark.parametrize("seed", range(12))
def test_index_equals_engine_cache_after_random_workload(seed):
    rng = random.Random(seed)
    block_size = rng.choice([2, 4])
    eng = SimEngine("d0", num_blocks=rng.choice([48, 64]) // block_size, block_size=block_size)
    max_prompt = eng.sched.config.max_model_len - 6
    index = PrefixIndex()
    index.add_engine("d0", "decode", 40)
    prefixes = [[rng.randrange(1000) for _ in range(rng.randrange(4, 24))] for _ in range(4)]
    live: list[str] = []
    for i in range(60):
        if rng.random() < 0.7:
            tokens = rng.choice(prefixes) + [rng.randrange(1000) for _ in range(rng.randrange(12))]
            rid = f"r{i}"
            eng.add(
                rid,
                tokens[:max_prompt],
                max_tokens=rng.randrange(1, 6),
                salt=rng.choice([None, "t"]),
            )
            live.append(rid)
        if live and rng.random() < 0.1:
            eng.abort(live.pop(rng.randrange(len(live))))
        for _ in range(rng.randrange(0, 4)):
            if eng.sched.has_work():
                eng.step()
        if not eng.sched.has_work() and rng.random() < 0.1:
            assert eng.reset_prefix_cache()
        _feed(index, eng)
        assert index.hashes_of("d0") == eng.cached()
        index.check_integrity()
        eng.sched.check_integrity(idle=False)
    eng.run_until_idle()
    _feed(index, eng)
    assert index.hashes_of("d0") == eng.cached()
    eng.sched.check_integrity()


def test_stored_event_names_parent_and_token_count():
    eng = SimEngine("d0", block_size=4)
    eng.add("a", list(range(10)), max_tokens=1)
    eng.run_until_idle()
    stored = [ev for b in eng.take_batches() for ev in b.events if isinstance(ev, BlockStored)]
    assert [len(ev.block_hashes) for ev in stored] == [2]
    assert stored[0].parent_block_hash is None and stored[0].num_tokens == 8
    eng.add("b", list(range(14)), max_tokens=1)  # blocks 0-1 hit, block 2 new
    eng.run_until_idle()
    stored = [ev for b in eng.take_batches() for ev in b.events if isinstance(ev, BlockStored)]
    assert len(stored) == 1 and stored[0].num_tokens == 4
    assert stored[0].parent_block_hash in eng.cached()


def _incarnation(epoch: int, first_token: int) -> SimEngine:
    eng = SimEngine("d0", epoch=epoch)
    eng.add(f"e{epoch}", list(range(first_token, first_token + 20)))
    eng.run_until_idle()
    return eng


@pytest.mark.parametrize("health_check_first", [True, False])
def test_restarted_engine_entries_vanish_on_new_epoch(health_check_first):
    index = PrefixIndex()
    index.add_engine("d0", "decode", 64)
    old = _incarnation(1, 0)
    _feed(index, old)
    assert index.hashes_of("d0") == old.cached() and old.cached()
    if health_check_first:  # the health check sees the new epoch before its events
        index.drop_engine_state("d0", epoch=2)
        assert index.hashes_of("d0") == set()
    new = _incarnation(2, 100)
    _feed(index, new)  # else: its first batch (seq 1, epoch 2) drops the old entries
    assert index.hashes_of("d0") == new.cached()
    assert not index.hashes_of("d0") & old.cached()
    # a late batch of the old incarnation changes nothing
    assert index.apply(KVEventBatch("d0", 1, 99, 0.0, [BlockStored([b"x" * 32], None, 4)]))
    assert index.hashes_of("d0") == new.cached()
    index.check_integrity()


def test_seq_gap_marks_resync_and_snapshot_restores():
    index = PrefixIndex()
    index.add_engine("d0", "decode", 64)
    eng = SimEngine("d0", num_blocks=16)
    for i in range(6):
        eng.add(f"r{i}", [i] * 6 + list(range(i * 10, i * 10 + 9)))
        eng.run_until_idle()
    batches = eng.take_batches()
    assert len(batches) >= 3
    assert index.apply(batches[0])
    assert not index.apply(batches[2])  # batch 2 lost
    assert index.num_gaps == 1
    # an engine mid-resync is never predicted to hit
    assert index.match(list(index.hashes_of("d0"))[:1], ["d0"]) == {"d0": 0}
    assert not index.apply(batches[3])
    snap = eng.snapshot()
    assert snap.seq == batches[-1].seq
    index.load_snapshot(snap)
    for b in batches:  # replayed batches the snapshot covers are skipped
        assert index.apply(b)
    assert index.hashes_of("d0") == eng.cached()
    eng.add("z", list(range(500, 520)))
    eng.run_until_idle()
    _feed(index, eng)
    assert index.hashes_of("d0") == eng.cached()
    index.check_integrity()


def test_first_contact_mid_stream_needs_snapshot():
    index = PrefixIndex()
    index.add_engine("d0", "decode", 64)
    eng = SimEngine("d0")
    for i in range(3):
        eng.add(f"r{i}", list(range(i * 50, i * 50 + 12)))
        eng.run_until_idle()
    batches = eng.take_batches()
    assert not index.apply(batches[-1])  # joined late (PUB slow joiner)
    index.load_snapshot(eng.snapshot())
    assert index.hashes_of("d0") == eng.cached()


def test_index_memory_bounded_by_engine_capacity():
    index = PrefixIndex()
    index.add_engine("d0", "decode", 3)
    hashes = [bytes([i]) * 32 for i in range(5)]
    assert index.apply(KVEventBatch("d0", 1, 1, 0.0, [BlockStored(hashes, None, 20)]))
    assert index.hashes_of("d0") == set(hashes[2:])  # least recently stored go first
    assert index.num_lru_evictions == 2
    assert index.apply(KVEventBatch("d0", 1, 2, 0.0, [BlockRemoved([hashes[3]])]))
    assert index.hashes_of("d0") == {hashes[2], hashes[4]}
    index.check_integrity()
    with pytest.raises(ValueError, match="capacity_blocks"):
        index.add_engine("d1", "decode", 0)


def test_match_counts_leading_blocks_per_engine():
    index = PrefixIndex()
    for eid in ("a", "b"):
        index.add_engine(eid, "decode", 10)
    h = [bytes([i]) * 32 for i in range(4)]
    index.apply(KVEventBatch("a", 1, 1, 0.0, [BlockStored(h[:3], None, 12)]))
    index.apply(KVEventBatch("b", 1, 1, 0.0, [BlockStored(h[:1], None, 4)]))
    index.apply(KVEventBatch("b", 1, 2, 0.0, [BlockStored(h[2:4], h[1], 8)]))  # hole at h1
    assert index.match(h, ["a", "b", "c"]) == {"a": 3, "b": 1, "c": 0}
