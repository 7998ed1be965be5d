"""KV tiers in the real service (local Ray, colocated tiny engine, openai client): a
conversation pushed out of a small device cache comes back from the host tier, and
``usage.prompt_tokens_details.cached_tokens`` counts it; /metrics exposes
``tandem:kv_offload_*`` and /cluster/state the engine's tier."""

from __future__ import annotations

import time

import httpx
import pytest

from tandem.cluster.cli.serve import ServiceThread
from tandem.cluster.cli.settings import serve_config
from tests import shared_ray
from tests.cluster.service_helpers import client, wait_idle

pytestmark = [pytest.mark.slow, pytest.mark.shared_ray]


def test_cached_tokens_from_the_host_tier_through_the_openai_client():
    config = serve_config(
        model="tiny",
        ray_dashboard=False,
        colocated=1,
        num_kv_blocks=24,  # 384 tokens of device cache
        max_model_len=256,
        max_num_seqs=4,
        kv_offloading_size=0.01,
    )
    shared_ray.start()
    try:
        with ServiceThread(config) as svc:
            c = client(svc)

            def chat(messages):
                r = c.chat.completions.create(
                    model="tiny", messages=messages, max_tokens=4, temperature=0
                )
                return r.choices[0].message.content, r.usage

            history = [{"role": "user", "content": "Tell me about tiered KV caches. " * 3}]
            answer, first = chat(history)
            assert first.prompt_tokens_details.cached_tokens == 0
            for i in range(3):  # other conversations push it out of the device cache
                chat([{"role": "user", "content": f"An unrelated question {i}. " * 6}])
            wait_idle(svc)
            history += [
                {"role": "assistant", "content": answer},
                {"role": "user", "content": "And the disk tier?"},
            ]
            _, second = chat(history)
            full = (first.prompt_tokens - 1) // 16 * 16
            assert second.prompt_tokens_details.cached_tokens >= full > 0
            end = time.monotonic() + 15  # engine stats reach the gateway with its health poll
            while True:
                metrics = httpx.get(svc.base_url + "/metrics", timeout=10).text
                hits = [
                    float(line.split()[-1])
                    for line in metrics.splitlines()
                    if line.startswith("tandem:kv_offload_hits_total") and 'medium="host"' in line
                ]
                if hits and hits[0] > 0:
                    break
                assert time.monotonic() < end, "no tandem:kv_offload_hits_total sample"
                time.sleep(0.5)
            state = httpx.get(svc.base_url + "/cluster/state", timeout=10).json()
            (engine,) = state["engines"]
            (tier,) = engine["kv_tiers"]
            assert tier["medium"] == "host" and tier["hits"] > 0 and tier["used_bytes"] > 0
            wait_idle(svc)
    finally:
        shared_ray.release()
