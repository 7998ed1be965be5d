"""Speculative decoding on the real SmolLM2-135M (built-in GGUF, fp32): greedy tokens
identical with and without n-gram drafts on text that copies its prompt (drafts mostly
accepted) and on free text, with chunked prefill, a stop token inside an accepted run,
and two choices (n=2); and with smollm2 drafting for itself as a draft model."""

from __future__ import annotations

import pytest

from tandem.wire.engine_protocol import EngineRequest, SamplingParams
from tandem.workers.config import EngineConfig
from tandem.workers.engine.core import EngineCore
from tandem.workers.text.tokenizer import apply_chat_template, load_tokenizer

pytestmark = pytest.mark.slow

CODE = """def at_output_limit(req, max_model_len):
    num_pending = req.num_output_placeholders
    return (
        req.num_output_tokens + num_pending >= req.sampling_params.max_tokens
        or req.num_tokens + num_pending >= max_model_len
    )
"""
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
         "prompt_lookup_max": 4}  # fmt: skip
DRAFT = {"method": "draft_model", "model": "smollm2", "num_speculative_tokens": 4}


def generate(spec, requests):
    engine = EngineCore(
        EngineConfig.from_flat(
            model="smollm2", dtype="float32", num_kv_blocks=96, max_num_batched_tokens=48,
            max_model_len=512, speculative_config=spec,
        )
    )  # fmt: skip
    tokens = {}
    for i, (prompt, sp, n) in enumerate(requests):
        assert engine.add_request(EngineRequest(f"r{i}", prompt, sp, n=n)) is None
        for k in range(n):
            tokens[(f"r{i}", k)] = []
    while engine.has_work():
        for o in engine.step().outputs:
            assert o.error is None, o.error
            tokens[(o.request_id, o.index)].extend(o.new_token_ids)
    engine.check_integrity()
    stats = engine.scheduler.make_stats()
    engine.shutdown()
    return tokens, stats


@pytest.fixture(scope="module")
def cases():
    """The requests and the plain engine's tokens for them."""
    from tandem.workers.checkpoints.loader import resolve_model_path

    tokenizer = load_tokenizer(resolve_model_path("smollm2"))

    def chat(text):
        return apply_chat_template(tokenizer, [{"role": "user", "content": text}])

    copy = chat("Repeat this code, renaming `req` to `request`:\n\n```python\n" + CODE + "```")
    free = chat("Write two sentences about the sea.")
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    plain, _ = generate(None, [(copy, greedy, 1), (free, greedy, 1)])
    stop_at = plain[("r0", 0)][20]  # a token inside the copied code
    requests = [
        (copy, greedy, 1),
        (free, greedy, 2),
        (copy, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True,
                              stop_token_ids=[stop_at]), 1),
    ]  # fmt: skip
    want, _ = generate(None, requests)
    assert want[("r0", 0)] == plain[("r0", 0)] and want[("r1", 0)] == want[("r1", 1)]
    assert len(want[("r2", 0)]) <= 21
    return requests, want


def test_greedy_identical_on_smollm2(cases):
    requests, want = cases
    got, stats = generate(NGRAM, requests)
    assert got == want
    assert stats.spec_decode_num_accepted_tokens > stats.spec_decode_num_draft_tokens // 2


def test_smollm2_drafting_for_itself(cases):
    """smollm2 as its own draft model (shared weights, its own KV cache): the plain
    engine's tokens, free text included, with nearly every draft accepted."""
    requests, want = cases
    got, stats = generate(DRAFT, requests)
    assert got == want
    assert stats.spec_decode_num_draft_tokens > 0
    assert stats.spec_decode_num_accepted_tokens > 0.9 * stats.spec_decode_num_draft_tokens
