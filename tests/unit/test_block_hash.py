"""Prefix-cache block hashes: exact bytes, chaining, salts, algorithms, and
tenant isolation in the scheduler (blocks shared only between equal salts)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import pytest
import xxhash

from tandem.scheduler import Request, Scheduler, SchedulerConfig
from tandem.scheduler.block_hash import (
    HASH_ALGOS,
    encode_block,
    get_block_hasher,
    hash_block_tokens,
    hash_request_blocks,
)
from tandem.scheduler.kv_cache_manager import KVCacheManager
from tandem.wire.engine_protocol import SamplingParams
from tests.unit.fakes import FakeRunner, step

# msgpack of [nil, [1, 2, 3, 200, 70000], ["t1"]], written out by hand:
# 0x93 array(3) | 0xc0 nil | 0x95 array(5) 01 02 03, 0xcc c8 (uint8 200),
# 0xce 00 01 11 70 (uint32 70000) | 0x91 array(1) 0xa2 "t1"
BLOCK0_BYTES = bytes.fromhex("93c095010203ccc8ce0001117091a27431")
TOKENS0 = [1, 2, 3, 200, 70000]


def test_default_hash_is_sha256_of_parent_tokens_and_salt():
    assert encode_block(None, TOKENS0, ("t1",)) == BLOCK0_BYTES
    h0 = hash_block_tokens(None, TOKENS0, ("t1",))
    assert h0 == hashlib.sha256(BLOCK0_BYTES).digest()
    # the next block: parent as bin8 (0xc4, length 32), tokens [4, 5], no extra keys
    h1 = hash_block_tokens(h0, [4, 5])
    assert h1 == hashlib.sha256(b"\x93\xc4\x20" + h0 + b"\x92\x04\x05\x90").digest()
    # the request-level function chains the same way and salts block 0 only
    tokens = TOKENS0 + [4, 5, 6, 7, 8] + [9, 10]  # two full blocks of 5, then a partial one
    hashes = hash_request_blocks(tokens, 5, cache_salt="t1")
    h1b = hash_block_tokens(h0, [4, 5, 6, 7, 8])
    assert hashes == [h0, h1b]


def test_other_algorithms_digest_the_same_bytes():
    assert hash_block_tokens(None, TOKENS0, ("t1",), "xxhash128") == xxhash.xxh3_128_digest(
        BLOCK0_BYTES
    )
    b = hash_block_tokens(None, TOKENS0, ("t1",), "builtin")
    assert len(b) == 8 and b == hash_block_tokens(None, TOKENS0, ("t1",), "builtin")
    assert b != hash_block_tokens(None, TOKENS0, ("t2",), "builtin")


@pytest.mark.parametrize("algo", HASH_ALGOS)
def test_chaining_extension_and_salts(algo):
    tokens = list(range(100, 140))  # 10 full blocks of 4
    full = hash_request_blocks(tokens, 4, algo=algo)
    assert len(full) == 10 and len(set(full)) == 10
    # extending a known prefix of hashes gives the same hashes
    head = hash_request_blocks(tokens, 4, algo=algo, num_blocks=3)
    assert head + hash_request_blocks(tokens, 4, algo=algo, prev_hashes=head) == full
    # a salt (or a different one) changes every block, not just the first
    a = hash_request_blocks(tokens, 4, algo=algo, cache_salt="a")
    b = hash_request_blocks(tokens, 4, algo=algo, cache_salt="b")
    assert not set(a) & set(full) and not set(a) & set(b)
    assert a == hash_request_blocks(tokens, 4, algo=algo, cache_salt="a")
    # a change in block 2 changes blocks 2.. only
    other = hash_request_blocks(tokens[:9] + [7] + tokens[10:], 4, algo=algo)
    assert other[:2] == full[:2] and not set(other[2:]) & set(full)


def test_sha256_is_the_same_in_every_process():
    code = (
        "from tandem.scheduler.block_hash import hash_request_blocks as h;"
        "print(b''.join(h(list(range(64)), 16, cache_salt='tenant')).hex())"
    )
    outs = set()
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        outs.add(
            subprocess.run(
                [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
            ).stdout.strip()
        )
    assert outs == {b"".join(hash_request_blocks(list(range(64)), 16, cache_salt="tenant")).hex()}


def test_unknown_algo_names_the_field():
    with pytest.raises(ValueError, match="prefix_caching_hash_algo"):
        get_block_hasher("md5")
    with pytest.raises(ValueError, match="prefix_caching_hash_algo"):
        SchedulerConfig(prefix_caching_hash_algo="md5")
    with pytest.raises(ValueError, match="prefix_caching_hash_algo"):
        KVCacheManager(8, 4, hash_algo="")


def test_empty_or_non_string_salt_is_refused():
    s = Scheduler(SchedulerConfig(num_kv_blocks=16, block_size=4, max_model_len=32))
    for salt in ("", 5):
        with pytest.raises(ValueError, match="cache_salt"):
            s.add_request(Request("x", [1, 2], SamplingParams(), cache_salt=salt))
    s.check_integrity()


@pytest.mark.parametrize("algo", HASH_ALGOS)
def test_scheduler_shares_blocks_only_between_equal_salts(algo):
    cfg = SchedulerConfig(
        num_kv_blocks=64,
        block_size=4,
        max_num_batched_tokens=64,
        max_model_len=64,
        prefix_caching_hash_algo=algo,
    )
    s = Scheduler(cfg)
    runner = FakeRunner()
    prompt = list(range(50, 63))  # 3 full blocks + 1 token
    sp = SamplingParams(max_tokens=6)
    s.add_request(Request("a", prompt, sp, cache_salt="tenant-a"))
    step(s, runner)  # a's prompt is computed and its 3 full blocks published
    blocks_a = s.kv.get_block_ids("a")
    for rid, salt in (("a2", "tenant-a"), ("b", "tenant-b"), ("none", None)):
        s.add_request(Request(rid, prompt, sp, cache_salt=salt))
    so, eo = step(s, runner)
    new = {n.req_id: n for n in so.scheduled_new_reqs}
    assert new["a2"].num_computed_tokens == 12 and new["a2"].block_ids[:3] == blocks_a[:3]
    for rid in ("b", "none"):
        assert new[rid].num_computed_tokens == 0
        assert not set(new[rid].block_ids) & set(blocks_a)
    # the first output of each request reports its prefix hit
    first = {o.request_id: o.num_cached_tokens for o in eo.outputs if o.request_id != "a"}
    assert first == {"a2": 12, "b": 0, "none": 0}
    assert {r: s.requests[r].num_cached_tokens for r in first} == first
    while s.has_work():
        _, eo = step(s, runner)
        for o in eo.outputs:
            if o.finished:  # the final output repeats it
                assert o.num_cached_tokens == first.get(o.request_id, 0)
    s.check_integrity()
