"""Sampling fields through the real service (Ray engine actors, ZMQ, NIXL
handoff, gateway), driven by the official openai client: the colocated and
the prefill/decode service give the same tokens with penalties, logit_bias
forces a token, echo returns the prompt, chat top_logprobs has OpenAI's
shape."""

from __future__ import annotations

import pytest

from tandem.cluster.cli.serve import ServiceThread
from tandem.cluster.cli.settings import serve_config
from tests import shared_ray
from tests.cluster.service_helpers import client, wait_idle

pytestmark = [pytest.mark.slow, pytest.mark.shared_ray]

ENGINE = {"num_kv_blocks": 128, "max_num_seqs": 16, "max_model_len": 512}
PROMPT = "The history of disaggregated serving, and of serving again"


def _service(**kw) -> ServiceThread:
    config = serve_config(model="tiny", ray_dashboard=False, max_restarts=1, **ENGINE, **kw)
    return ServiceThread(config)


@pytest.fixture(scope="module")
def services():
    shared_ray.start()
    try:
        with _service(prefill=1, decode=1, kv_lease_s=5.0) as disagg:
            with _service(colocated=1, prefill=0, decode=0) as colocated:
                yield disagg, colocated
    finally:
        shared_ray.release()


def _completion(svc, **kw):
    args = dict(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0)
    extra = {"ignore_eos": True, **kw.pop("extra_body", {})}
    return client(svc).completions.create(**{**args, **kw}, extra_body=extra)


def test_penalties_change_the_output_and_pd_equals_colocated(services):
    disagg, colocated = services
    plain = _completion(colocated).choices[0].text
    for kw in (
        dict(presence_penalty=2.0),
        dict(frequency_penalty=1.5),
        dict(extra_body={"repetition_penalty": 3.0}),
        dict(temperature=1.0, seed=5, frequency_penalty=1.0, extra_body={"min_p": 0.05}),
    ):
        a = _completion(disagg, **kw).choices[0].text
        b = _completion(colocated, **kw).choices[0].text
        assert a == b, kw
        if "seed" not in kw:
            assert a != plain, kw
    wait_idle(disagg)
    wait_idle(colocated)


def test_logit_bias_echo_and_top_logprobs(services):
    disagg, colocated = services
    tokenizer = disagg.service.backend.tokenizer
    (forced,) = tokenizer.encode("Q", add_special_tokens=False)
    for svc in services:
        r = _completion(svc, max_tokens=6, logit_bias={str(forced): 100})
        assert r.choices[0].text == "Q" * 6
        r = _completion(svc, max_tokens=4, echo=True, logprobs=1)
        assert r.choices[0].text.startswith(PROMPT)
        assert r.choices[0].logprobs.token_logprobs[0] is None
        assert len(r.choices[0].logprobs.tokens) == r.usage.prompt_tokens + 4
        chat = client(svc).chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=3,
            logprobs=True,
            top_logprobs=4,
        )
        content = chat.choices[0].logprobs.content
        assert len(content) == chat.usage.completion_tokens
        for token in content:
            assert len(token.top_logprobs) == 4
            values = [t.logprob for t in token.top_logprobs]
            assert values == sorted(values, reverse=True) and token.logprob <= values[0]
        wait_idle(svc)
