"""KV tiers of a tensor-parallel engine in the real service (local Ray, a colocated
tiny engine of TP=2 whose rank 1 is a Ray actor, openai client): a conversation pushed
out of the small device cache comes back from both ranks' host tiers, counted in
``usage.prompt_tokens_details.cached_tokens``, with the text of a TP=1 engine without
tiers (kvtransfer/tiers/ranks.py)."""

from __future__ import annotations

import pytest

from tandem.cluster.cli.serve import ServiceThread
from tandem.cluster.cli.settings import serve_config
from tandem.wire.engine_protocol import SamplingParams
from tandem.workers.config import EngineConfig
from tandem.workers.engine.llm import LLM
from tests import shared_ray
from tests.cluster.service_helpers import client, wait_idle

pytestmark = [pytest.mark.slow, pytest.mark.shared_ray]

PROMPT = "Tell me about tiered KV caches under tensor parallelism. " * 3


def test_tp2_engine_serves_cached_tokens_from_every_ranks_host_tier():
    sp = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    with LLM(EngineConfig.from_flat(model="tiny", num_kv_blocks=64)) as ref:
        (expected,) = [r.text for r in ref.generate([PROMPT], sp)]
    config = serve_config(
        model="tiny",
        ray_dashboard=False,
        colocated=1,
        num_kv_blocks=24,  # 384 tokens of device cache
        max_model_len=256,
        max_num_seqs=4,
        torch_threads=1,
        kv_offloading_size=0.01,  # per rank
        tensor_parallel_size=2,
    )
    shared_ray.start()
    try:
        with ServiceThread(config) as svc:
            c = client(svc)

            def complete(prompt: str):
                r = c.completions.create(
                    model="tiny",
                    prompt=prompt,
                    max_tokens=4,
                    temperature=0,
                    extra_body={"ignore_eos": True},
                )
                return r.choices[0].text, r.usage

            text, first = complete(PROMPT)
            assert text == expected and first.prompt_tokens_details.cached_tokens == 0
            for i in range(3):  # other prompts push it out of the device cache
                complete(f"An unrelated question {i}. " * 6)
            wait_idle(svc)
            text, second = complete(PROMPT)
            full = (first.prompt_tokens - 1) // 16 * 16
            assert text == expected
            assert second.prompt_tokens_details.cached_tokens >= full > 0
            wait_idle(svc)
    finally:
        shared_ray.release()
