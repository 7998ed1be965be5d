"""Speculative decoding under prefill/decode: the decode engine speculates (n-gram), real
NIXL between a prefill and a decode process; the split's tokens equal one engine's."""

from __future__ import annotations

import pytest
import torch

from tandem.wire.engine_protocol import SamplingParams
from tandem.workers.config import EngineConfig
from tandem.workers.engine.llm import LLM
from tests.e2e.engine_proc import Harness
from tests.e2e.test_pd_engines import BASE, handoff

pytestmark = pytest.mark.slow

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}  # fmt: skip


def draft_spec(ckpt: str) -> dict:
    return {"method": "draft_model", "model": ckpt, "num_speculative_tokens": 4}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from tests.workers.hf_checkpoints import make_checkpoint

    return make_checkpoint("llama", tmp_path_factory.mktemp("pd-spec-llama"))


@pytest.fixture(scope="module")
def pd(ckpt):
    h = Harness()
    try:
        common = dict(BASE, model=ckpt, kv_connector="nixl", kv_lease_s=3.0)
        h.start("P", EngineConfig.from_flat(role="prefill", **common))
        h.start(
            "D", EngineConfig.from_flat(role="decode", kv_load_timeout_s=5.0, speculative_config=NGRAM,
                              **common)
        )  # fmt: skip
        yield h
    finally:
        h.close()


def test_decode_engine_speculates_and_equals_colocated(pd, ckpt):
    prompts = [[5, 6, 7, 8] * 12, list(range(20, 60)) * 2, [9, 10, 11] * 3]
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    seeded = SamplingParams(max_tokens=30, temperature=0.9, seed=42, ignore_eos=True)
    plain = LLM(EngineConfig.from_flat(model=ckpt, **BASE))
    spec = LLM(EngineConfig.from_flat(model=ckpt, speculative_config=NGRAM, **BASE))
    for i, prompt in enumerate(prompts):
        (want,) = plain.generate(prompt_token_ids=[prompt], sampling_params=greedy)
        toks, _, _ = handoff(pd, f"g{i}", prompt, greedy)
        assert toks == want.token_ids, i
        # sampled: D's rejection sampling draws what one speculating engine draws
        (want,) = spec.generate(prompt_token_ids=[prompt], sampling_params=seeded)
        toks, _, _ = handoff(pd, f"s{i}", prompt, seeded)
        assert toks == want.token_ids, i
    spec.engine.check_integrity()
    pd.wait_idle("P")
    stats = pd.wait_idle("D").scheduler
    assert stats.spec_decode_num_drafts > 0 and stats.spec_decode_num_accepted_tokens > 0
    assert pd.stats("P").scheduler.spec_decode_num_drafts == 0


@pytest.fixture(scope="module")
def pd_draft(ckpt):
    """D drafts with a draft model (the target's own checkpoint: same weights, its own
    KV cache). The handoff carries the target's KV only: D's draft recomputes the prompt."""
    h = Harness()
    try:
        common = dict(BASE, model=ckpt, kv_connector="nixl", kv_lease_s=3.0)
        spec = draft_spec(ckpt)
        h.start("P", EngineConfig.from_flat(role="prefill", **common))
        h.start(
            "D", EngineConfig.from_flat(role="decode", kv_load_timeout_s=5.0, speculative_config=spec,
                              **common)
        )  # fmt: skip
        yield h
    finally:
        h.close()


def test_decode_engine_drafts_with_a_draft_model(pd_draft, ckpt):
    """D's draft recomputes each handed-off prompt, chunked by D's token budget (BASE's
    64: the 150-token prompt takes several steps): greedy tokens equal one plain engine's,
    seeded ones one speculating engine's (whose draft catches up after its own prefill,
    chunked by the same budget; a seeded request waits for its draft, so neither depends
    on how the catch-up was split)."""
    g = torch.Generator().manual_seed(4)
    long = torch.randint(3, 300, (150,), generator=g).tolist()
    prompts = [[5, 6, 7, 8] * 12, list(range(20, 60)) * 2, long]
    greedy = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    seeded = SamplingParams(max_tokens=24, temperature=0.9, seed=42, ignore_eos=True)
    plain = LLM(EngineConfig.from_flat(model=ckpt, **BASE))
    spec = LLM(EngineConfig.from_flat(model=ckpt, speculative_config=draft_spec(ckpt), **BASE))
    for i, prompt in enumerate(prompts):
        (want,) = plain.generate(prompt_token_ids=[prompt], sampling_params=greedy)
        toks, _, _ = handoff(pd_draft, f"g{i}", prompt, greedy)
        assert toks == want.token_ids, i
    (want,) = spec.generate(prompt_token_ids=[long], sampling_params=seeded)
    toks, _, _ = handoff(pd_draft, "s", long, seeded)
    assert toks == want.token_ids
    spec.engine.check_integrity()
    pd_draft.wait_idle("P")
    stats = pd_draft.wait_idle("D").scheduler
    # nearly every draft kept: the draft's KV of the prompt (recomputed on D) is valid
    assert stats.spec_decode_num_draft_tokens > 0
    assert stats.spec_decode_num_accepted_tokens > 0.9 * stats.spec_decode_num_draft_tokens
