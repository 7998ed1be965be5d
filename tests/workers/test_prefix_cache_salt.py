"""Prefix caching through ``LLM``: each hash algorithm gives the same tokens,
a repeated prompt hits the cache, and ``cache_salt`` isolates tenants."""

from __future__ import annotations

import pytest

from tandem.scheduler.block_hash import HASH_ALGOS
from tandem.wire.engine_protocol import SamplingParams
from tandem.workers.config import EngineConfig
from tandem.workers.engine.llm import LLM

PROMPT = list(range(40, 90))  # 50 tokens: 3 full blocks of 16 + 2 tokens


@pytest.mark.parametrize("algo", HASH_ALGOS)
def test_salted_prefix_hits_on_one_engine(algo):
    llm = LLM(EngineConfig.from_flat(model="tiny", num_kv_blocks=64, prefix_caching_hash_algo=algo))
    sp = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)

    def run(salt):
        (r,) = llm.generate(prompt_token_ids=[PROMPT], sampling_params=sp, cache_salt=salt)
        assert r.finish_reason == "length"
        return r

    first = run("tenant-a")
    assert first.num_cached_tokens == 0
    again = run("tenant-a")
    assert again.num_cached_tokens == 48 and again.token_ids == first.token_ids
    other = run("tenant-b")
    assert other.num_cached_tokens == 0 and other.token_ids == first.token_ids
    assert run(None).num_cached_tokens == 0
    assert run(None).num_cached_tokens == 48
    assert run("tenant-b").num_cached_tokens == 48
    llm.engine.check_integrity()


def test_bad_salt_and_algo_are_named():
    llm = LLM(EngineConfig.from_flat(model="tiny", num_kv_blocks=16))
    (r,) = llm.generate(prompt_token_ids=[[1, 2, 3]], cache_salt="")
    assert r.finish_reason == "error" and "cache_salt" in r.error
    llm.engine.check_integrity()
    with pytest.raises(ValueError, match="prefix_caching_hash_algo"):
        EngineConfig.from_flat(prefix_caching_hash_algo="sha1")
