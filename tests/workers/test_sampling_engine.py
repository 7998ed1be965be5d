"""Sampling features through the engine: the same tokens whether a request
is chunked, preempted, handed off (P/D style) or batched with others."""

from __future__ import annotations

import msgspec
import pytest
import torch

from tandem.kvtransfer.handoff import decode_request, prefill_request
from tandem.wire.engine_protocol import EngineOutput, EngineRequest, SamplingParams
from tandem.workers.config import EngineConfig
from tandem.workers.engine.llm import LLM

PROMPT = [256, *range(40, 90), 72, 101, 108, 108, 111, 40, 41, 42]
FEATURES = [
    dict(temperature=1.0, seed=7, presence_penalty=1.2, frequency_penalty=0.4),
    dict(temperature=0.8, seed=11, repetition_penalty=1.6, min_p=0.05, top_k=40),
    dict(temperature=0.0, frequency_penalty=1.5, logit_bias={45: 3.0, 46: -100.0}),
    dict(temperature=1.0, seed=5, bad_words_token_ids=[[101], [40, 41]], repetition_penalty=0.7),
]


def _params(**kw) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 24, "ignore_eos": True, **kw})


def _run(llm: LLM, prompts, params) -> list[list[int]]:
    out = [r.token_ids for r in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
    llm.engine.check_integrity()
    llm.engine.runner.extras.check_integrity()
    assert llm.engine.runner.extras.num_tracked == 0
    return out


@pytest.fixture(scope="module")
def whole(tiny_model_dir):
    return LLM(EngineConfig.from_flat(model=tiny_model_dir, num_kv_blocks=64))


@pytest.mark.parametrize("features", FEATURES)
def test_same_tokens_chunked_preempted_batched_or_handed_off(tiny_model_dir, whole, features):
    params = _params(**features)
    (alone,) = _run(whole, [PROMPT], [params])
    # the features change the output (against the same request without them)
    base = {k: v for k, v in features.items() if k in ("temperature", "seed", "top_k")}
    (plain,) = _run(whole, [PROMPT], [_params(**base)])
    assert alone != plain
    # chunked prefill (budget 16 tokens per step)
    chunked = LLM(
        EngineConfig.from_flat(model=tiny_model_dir, num_kv_blocks=64, max_num_batched_tokens=16)
    )
    assert _run(chunked, [PROMPT], [params]) == [alone]
    # batched with requests that use other features, or none
    mates = [_params(temperature=1.0), _params(**FEATURES[(FEATURES.index(features) + 1) % 4])]
    together = _run(whole, [[1, 2, 3], PROMPT, [9] * 20], [mates[0], params, mates[1]])
    assert together[1] == alone
    # handoff: first token on one engine, the rest on another that sees it in the prompt
    req = EngineRequest("h", PROMPT, params)
    first = _one(whole, prefill_request(req))
    rest = _one(
        chunked, msgspec.structs.replace(decode_request(req, first), kv_transfer_params=None)
    )
    assert first.new_token_ids + rest.new_token_ids == alone


def test_same_tokens_after_preemption(tiny_model_dir, whole):
    params = [_params(**f) for f in FEATURES]
    prompts = [PROMPT, PROMPT[5:], PROMPT[10:], PROMPT[::-1]]
    expected = _run(whole, prompts, params)
    small = LLM(EngineConfig.from_flat(model=tiny_model_dir, block_size=8, num_kv_blocks=16))
    assert _run(small, prompts, params) == expected
    assert small.engine.scheduler.num_preemptions > 0


def _one(llm: LLM, request: EngineRequest) -> EngineOutput:
    """Run one request to the end; its tokens in one EngineOutput."""
    assert llm.engine.add_request(request) is None
    tokens: list[int] = []
    while llm.engine.has_work():
        for out in llm.engine.step().outputs:
            tokens.extend(out.new_token_ids)
            if out.finished:
                final = out
    llm.engine.check_integrity()
    return msgspec.structs.replace(final, new_token_ids=tokens)


def _outputs(llm: LLM, request: EngineRequest) -> list[EngineOutput]:
    assert llm.engine.add_request(request) is None
    outputs = []
    while llm.engine.has_work():
        outputs += [o for o in llm.engine.step().outputs if o.request_id == request.request_id]
    llm.engine.check_integrity()
    return outputs


@pytest.mark.parametrize("budget", [2048, 16, 7])
def test_prompt_logprobs_match_transformers_chunked_or_not_and_skip_the_cache(
    make_checkpoint, budget
):
    from tests.workers.hf_checkpoints import load_hf_model

    path = make_checkpoint("llama")
    prompt = [3, *range(40, 75), 9, 9, 9]
    llm = LLM(EngineConfig.from_flat(model=path, num_kv_blocks=64, block_size=8,
                           max_num_batched_tokens=budget))  # fmt: skip
    # the same prompt first without: its blocks are cached, yet not used below
    _outputs(llm, EngineRequest("warm", prompt, _params(temperature=0.0, max_tokens=2)))
    sp = _params(temperature=0.0, max_tokens=3, prompt_logprobs=5)
    outputs = _outputs(llm, EngineRequest("p", prompt, sp))
    first = next(o for o in outputs if o.new_token_ids)
    assert all(o.prompt_logprobs is None for o in outputs if o is not first)
    got = first.prompt_logprobs
    assert first.num_cached_tokens == 0
    assert [lp.token_id for lp in got] == prompt[1:]
    hf = load_hf_model(path)
    with torch.inference_mode():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), -1)
    for i, lp in enumerate(got):
        row = ref[i]
        assert abs(lp.logprob - float(row[prompt[i + 1]])) < 1e-4
        # rank: 1 + tokens above it (rounding may move near-equal ones)
        target = row[prompt[i + 1]]
        assert (
            1 + int((row > target + 1e-4).sum()) <= lp.rank <= 1 + int((row > target - 1e-4).sum())
        )
        assert lp.top_token_ids == torch.topk(row, 5).indices.tolist()
    # a one-token prompt has no prompt logprobs (an empty list)
    (only,) = [o for o in _outputs(llm, EngineRequest("one", [5], sp)) if o.new_token_ids][:1]
    assert only.prompt_logprobs == []
