"""The real service (1 prefill + 1 decode, NIXL handoff) on the built-in
``smollm2``: completions and chat through the openai client equal offline
``tandem generate`` (same text, token count and finish reason), and a chat
answer ends with ``stop``."""

from __future__ import annotations

import time

import httpx
import pytest

from tandem.cluster.cli.serve import ServiceThread
from tandem.cluster.cli.settings import serve_config
from tandem.wire.engine_protocol import SamplingParams
from tandem.workers.config import EngineConfig
from tandem.workers.engine.llm import LLM
from tandem.workers.text.tokenizer import apply_chat_template
from tests import shared_ray
from tests.cluster.service_helpers import client, wait_idle

pytestmark = [pytest.mark.slow, pytest.mark.shared_ray]

ENGINE = {"num_kv_blocks": 128, "max_num_seqs": 16, "max_model_len": 1024}
PROMPTS = ["def fibonacci(n):\n    ", "The old lighthouse keeper climbed the stairs and"]
CHAT = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


@pytest.fixture(scope="module")
def service():
    shared_ray.start()
    config = serve_config(ray_dashboard=False, prefill=1, decode=1, kv_lease_s=5.0, **ENGINE)
    try:
        assert config.model == "smollm2"  # the default
        with ServiceThread(config) as svc:
            yield svc
    finally:
        shared_ray.release()


@pytest.fixture(scope="module")
def offline() -> LLM:
    return LLM(
        EngineConfig.from_flat(
            model="smollm2", num_kv_blocks=64, max_model_len=1024, torch_threads=1
        )
    )


def test_pd_completions_equal_tandem_generate(service, offline):
    sp = SamplingParams(max_tokens=16, temperature=0.0)
    expected = offline.generate(PROMPTS, sp)
    for prompt, want in zip(PROMPTS, expected):
        r = client(service, timeout_s=120).completions.create(
            model="smollm2", prompt=prompt, max_tokens=16, temperature=0
        )
        choice = r.choices[0]
        assert choice.text == want.text, prompt
        assert (choice.finish_reason, r.usage.completion_tokens) == (
            want.finish_reason,
            len(want.token_ids),
        )
    wait_idle(service)
    assert decode_bytes_received(service) > 0  # the prompts' KV went P -> D over NIXL


def decode_bytes_received(svc, deadline_s: float = 10.0) -> float:
    """``tandem:kv_transfer_bytes_total`` of the decode engine (stats arrive every 0.5 s)."""
    end = time.monotonic() + deadline_s
    while True:
        metrics = httpx.get(svc.base_url + "/metrics", timeout=10).text
        sent = [
            float(line.split()[-1])
            for line in metrics.splitlines()
            if line.startswith("tandem:kv_transfer_bytes_total") and 'role="decode"' in line
        ]
        if (sent and sent[0] > 0) or time.monotonic() > end:
            return sent[0] if sent else 0.0
        time.sleep(0.1)


def test_pd_chat_ends_with_stop_and_equals_generate(service, offline):
    ids = apply_chat_template(offline.tokenizer, CHAT)
    (want,) = offline.generate(
        prompt_token_ids=[ids], sampling_params=SamplingParams(max_tokens=64, temperature=0.0)
    )
    r = client(service, timeout_s=120).chat.completions.create(
        model="smollm2", messages=CHAT, max_tokens=64, temperature=0
    )
    assert r.choices[0].finish_reason == "stop" == want.finish_reason
    assert r.choices[0].message.content == want.text == "The capital of France is Paris."
    stream = client(service, timeout_s=120).chat.completions.create(
        model="smollm2", messages=CHAT, max_tokens=64, temperature=0, stream=True
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    wait_idle(service)
