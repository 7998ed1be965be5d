"""A prefill EngineCore and a decode EngineCore in separate processes, real
NIXL between them, joined by a ZMQ harness: the handoff of ARCHITECTURE §2."""

from __future__ import annotations

import time

import msgspec
import pytest
import torch

from tandem.kvtransfer.handoff import decode_request, prefill_request
from tandem.wire.engine_protocol import NOT_REACHED, EngineRequest, FinishReason, SamplingParams
from tandem.workers.config import EngineConfig
from tandem.workers.engine.llm import LLM
from tests.e2e.engine_proc import Harness
from tests.workers.hf_checkpoints import load_hf_model

pytestmark = pytest.mark.slow

BLOCK = 16
BUDGET = 64
BASE = dict(block_size=BLOCK, max_num_batched_tokens=BUDGET, num_kv_blocks=96, max_model_len=512)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from tests.workers.hf_checkpoints import make_checkpoint

    return make_checkpoint("llama", tmp_path_factory.mktemp("pd-llama"))


@pytest.fixture(scope="module")
def pd(ckpt):
    h = Harness()
    try:
        common = dict(BASE, model=ckpt, kv_connector="nixl", kv_lease_s=3.0)
        h.start("P", EngineConfig.from_flat(role="prefill", **common))
        h.start("D", EngineConfig.from_flat(role="decode", kv_load_timeout_s=5.0, **common))
        yield h
    finally:
        h.close()


def handoff(h: Harness, rid: str, prompt: list[int], sp: SamplingParams, p="P", d="D"):
    """Prefill on P (first token streamed), decode on D; returns all tokens."""
    req = EngineRequest(rid, prompt, sp)
    h.send(p, prefill_request(req))
    first = h.wait_final(rid, p)
    assert first.finish_reason == FinishReason.LENGTH, first
    d_req = decode_request(req, first)
    h.send(d, d_req)
    last = h.wait_final(rid, d)
    return first.new_token_ids + h.tokens(rid, d), last, d_req.kv_transfer_params


def kv_bytes(h: Harness, name: str) -> float:
    return h.stats(name).kv_transfer.transfer_bytes_total


def block_bytes(num_layers=2, kv_heads=2, head_dim=16) -> int:
    return num_layers * 2 * BLOCK * kv_heads * head_dim * 4


def test_greedy_split_equals_single_engine_and_transformers(pd, ckpt):
    g = torch.Generator().manual_seed(5)
    lens = [1, BLOCK, 5 * BLOCK + 3, BUDGET + 29]  # 1 token, one block, many, > budget
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in lens]
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    single = LLM(EngineConfig.from_flat(model=ckpt, **BASE)).generate(
        prompt_token_ids=prompts, sampling_params=sp
    )
    hf = load_hf_model(ckpt)
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    for i, prompt in enumerate(prompts):
        before = kv_bytes(pd, "D")
        toks, last, params = handoff(pd, f"g{i}", prompt, sp)
        with torch.inference_mode():
            ref = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=8)
        assert toks == single[i].token_ids == ref[0, len(prompt) :].tolist()
        assert last.finish_reason == FinishReason.LENGTH
        # every block of the prompt travelled (a short prompt still sends one)
        num_blocks = -(-len(prompt) // BLOCK)
        assert len(params["remote_block_ids"]) == num_blocks
        assert kv_bytes(pd, "D") - before == num_blocks * block_bytes()
    pd.wait_idle("P")
    pd.wait_idle("D")


def test_partial_prefix_hit_on_decode_reads_only_missing_blocks(pd):
    g = torch.Generator().manual_seed(9)
    shared = torch.randint(3, 300, (3 * BLOCK,), generator=g).tolist()
    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    # warm D's prefix cache with the 3 shared blocks (a local request on D)
    pd.send("D", EngineRequest("warm", shared + [7], sp))
    pd.wait_final("warm", "D")
    prompt = shared + torch.randint(3, 300, (2 * BLOCK + 5,), generator=g).tolist()
    before = kv_bytes(pd, "D")
    toks, _, params = handoff(pd, "hit", prompt, sp)
    assert len(params["remote_block_ids"]) == 6
    assert kv_bytes(pd, "D") - before == 3 * block_bytes()  # blocks 3, 4, 5 only
    assert len(toks) == 4
    pd.wait_idle("P")
    pd.wait_idle("D")


def test_cache_salt_isolates_tenants_across_the_handoff(pd, ckpt):
    g = torch.Generator().manual_seed(11)
    shared = torch.randint(3, 300, (3 * BLOCK,), generator=g).tolist()
    prompt = shared + torch.randint(3, 300, (2 * BLOCK + 5,), generator=g).tolist()
    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    (single,) = LLM(EngineConfig.from_flat(model=ckpt, **BASE)).generate(
        prompt_token_ids=[prompt], sampling_params=sp
    )
    # tenant A warms D's prefix cache with the 3 shared blocks
    pd.send("D", EngineRequest("warm-a", shared + [7], sp, cache_salt="tenant-a"))
    pd.wait_final("warm-a", "D")

    def salted_handoff(rid, salt):
        req = EngineRequest(rid, prompt, sp, cache_salt=salt)
        pd.send("P", prefill_request(req))
        first = pd.wait_final(rid, "P")
        d_req = decode_request(req, first)
        assert d_req.cache_salt == salt  # the salt travels with the handoff
        before = kv_bytes(pd, "D")
        pd.send("D", d_req)
        last = pd.wait_final(rid, "D")
        toks = first.new_token_ids + pd.tokens(rid, "D")
        assert toks == single.token_ids and last.finish_reason == FinishReason.LENGTH
        return first.num_cached_tokens, (kv_bytes(pd, "D") - before) // block_bytes()

    # tenant B: D must not use A's blocks, so all 6 blocks are read from P
    assert salted_handoff("salt-b", "tenant-b") == (0, 6)
    # tenant A: D's 3 local blocks are A's, only blocks 3..5 travel
    assert salted_handoff("salt-a", "tenant-a") == (0, 3)
    # tenant B again: P hits 5 full blocks (80 tokens); D has them too and
    # reads only the partial last block
    assert salted_handoff("salt-b2", "tenant-b") == (5 * BLOCK, 1)
    pd.wait_idle("P")
    pd.wait_idle("D")


def test_seeded_sampling_same_split_or_not(pd, ckpt):
    prompt = list(range(10, 60))
    sp = SamplingParams(max_tokens=10, temperature=1.0, top_k=50, seed=1234, ignore_eos=True)
    (single,) = LLM(EngineConfig.from_flat(model=ckpt, **BASE)).generate(
        prompt_token_ids=[prompt], sampling_params=sp
    )
    toks, _, _ = handoff(pd, "seeded", prompt, sp)
    assert toks == single.token_ids
    pd.wait_idle("P")
    pd.wait_idle("D")


def test_penalties_and_prompt_logprobs_same_split_or_not(pd, ckpt):
    """P applies the penalties to the first token (it has the prompt), D counts
    P's token as output: the same tokens as one engine, greedy and seeded."""
    prompt = [5, 6, 7, 5, 6, 7, *range(100, 140)]
    cases = [
        dict(temperature=0.0, presence_penalty=1.5, frequency_penalty=0.5, logit_bias={9: 2.0}),
        dict(temperature=1.0, seed=99, repetition_penalty=1.8, min_p=0.02),
        dict(temperature=0.0, repetition_penalty=2.0, bad_words_token_ids=[[7], [100, 101]]),
    ]
    single = LLM(EngineConfig.from_flat(model=ckpt, **BASE))
    for i, kw in enumerate(cases):
        sp = SamplingParams(max_tokens=12, ignore_eos=True, prompt_logprobs=2, **kw)
        (want,) = single.generate(prompt_token_ids=[prompt], sampling_params=sp)
        toks, _, _ = handoff(pd, f"pen{i}", prompt, sp)
        assert toks == want.token_ids, kw
    pd.wait_idle("P")
    pd.wait_idle("D")


def test_decode_never_reads_prefill_frees_at_lease_expiry(pd):
    sp = SamplingParams(max_tokens=1, temperature=0.0)
    pd.send(
        "P",
        EngineRequest(
            "orphan", list(range(5, 45)), sp, kv_transfer_params={"do_remote_decode": True}
        ),
    )
    pd.wait_final("orphan", "P")
    assert pd.stats("P").scheduler.num_blocks_held_for_transfer == 3
    t0 = time.monotonic()
    pd.wait_idle("P", timeout_s=15)  # lease is 3 s
    assert time.monotonic() - t0 < 10
    assert pd.stats("P").kv_transfer.lease_expiries_total >= 1


def test_abort_while_held_frees_at_once(pd):
    sp = SamplingParams(max_tokens=1, temperature=0.0)
    pd.send(
        "P",
        EngineRequest(
            "held", list(range(5, 45)), sp, kv_transfer_params={"do_remote_decode": True}
        ),
    )
    pd.wait_final("held", "P")
    pd.abort("P", "held")
    pd.wait_idle("P", timeout_s=2)


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_prefill_killed_before_read(ckpt, policy):
    h = Harness()
    try:
        common = dict(BASE, model=ckpt, kv_connector="nixl", kv_lease_s=30.0)
        h.start("P", EngineConfig.from_flat(role="prefill", **common))
        h.start(
            "D",
            EngineConfig.from_flat(
                role="decode", kv_load_timeout_s=3.0, load_failure_policy=policy, **common
            ),
        )
        prompt = list(range(20, 70))
        sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        req = EngineRequest("k", prompt, sp)
        h.send("P", prefill_request(req))
        first = h.wait_final("k", "P")
        h.engines["P"].kill()
        h.send("D", decode_request(req, first))
        last = h.wait_final("k", "D", timeout_s=60)
        if policy == "recompute":
            (single,) = LLM(EngineConfig.from_flat(model=ckpt, **BASE)).generate(
                prompt_token_ids=[prompt], sampling_params=sp
            )
            assert first.new_token_ids + h.tokens("k", "D") == single.token_ids
            assert last.finish_reason == FinishReason.LENGTH
        else:
            assert last.finish_reason == FinishReason.ERROR and last.error
        h.wait_idle("D")
    finally:
        h.close()


def test_decode_refuses_unregistered_prefill_engine_and_addresses(pd, ckpt):
    """D reads only from prefill engines the cluster registered: params naming
    an unknown engine, a wrong epoch, or carrying an address are refused (the
    load fails; recompute policy -> D computes the prompt itself, reads nothing)."""
    prompt = list(range(30, 70))
    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    (single,) = LLM(EngineConfig.from_flat(model=ckpt, **BASE)).generate(
        prompt_token_ids=[prompt], sampling_params=sp
    )
    req = EngineRequest("real", prompt, sp)
    pd.send("P", prefill_request(req))
    first = pd.wait_final("real", "P")
    good = decode_request(req, first).kv_transfer_params
    forged = {
        "unknown-engine": {**good, "remote_engine_id": "evil"},
        "stale-epoch": {**good, "remote_epoch": good.get("remote_epoch", 0) + 1},
        "address": {**good, "remote_host": "127.0.0.1", "remote_port": 9},
    }
    failures = pd.stats("D").kv_transfer.transfer_failures_total
    before = kv_bytes(pd, "D")
    for rid, params in forged.items():
        d_req = decode_request(EngineRequest(rid, prompt, sp), first)
        d_req = msgspec.structs.replace(d_req, kv_transfer_params=params)
        pd.send("D", d_req)
        last = pd.wait_final(rid, "D")
        assert last.finish_reason == FinishReason.LENGTH
        assert first.new_token_ids + pd.tokens(rid, "D") == single.token_ids  # recomputed
    assert kv_bytes(pd, "D") == before  # not one byte read from anywhere
    # the two refused loads
    assert pd.stats("D").kv_transfer.transfer_failures_total == failures + 2
    pd.send("D", decode_request(req, first))  # the registered one still reads (frees P)
    pd.wait_final("real", "D")
    assert kv_bytes(pd, "D") > before
    pd.wait_idle("P")
    pd.wait_idle("D")


def test_timings_of_both_legs(pd):
    """P reports queue and compute; D reports its KV READ (blocks, bytes,
    descriptors) before its compute; each on its final output only."""
    prompt = list(range(3, 3 + 3 * BLOCK + 2))  # 4 blocks
    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    req = EngineRequest("timed", prompt, sp)
    pd.send("P", prefill_request(req))
    first = pd.wait_final("timed", "P")
    p = first.timings
    assert (p.engine_id, p.role, p.epoch) == ("P", "prefill", pd.call("P", "stats")["epoch"])
    assert 0 <= p.scheduled_s <= p.first_token_s <= p.finished_s
    assert p.kv_load_start_s == NOT_REACHED and p.num_kv_blocks == 0
    pd.send("D", decode_request(req, first))
    last = pd.wait_final("timed", "D")
    d = last.timings
    assert (d.engine_id, d.role, d.epoch) == ("D", "decode", pd.call("D", "stats")["epoch"])
    assert 0 <= d.kv_load_start_s <= d.kv_load_end_s <= d.scheduled_s
    assert d.scheduled_s <= d.first_token_s <= d.finished_s and d.queue_s == d.kv_load_start_s
    assert d.num_kv_blocks == 4 and d.num_kv_bytes == 4 * block_bytes()
    assert 1 <= d.num_kv_descriptors <= 4
    pd.wait_idle("P")
    pd.wait_idle("D")
