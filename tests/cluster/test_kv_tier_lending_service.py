"""A prefix only another engine's host KV tier holds, lent by the gateway (real Ray, real
NIXL over UCX loopback, two colocated tiny engines with host tiers, openai client):
engine X computed the prompt and pushed it out of its small device cache into its host
tier; with X drained, the router picks Y for the same prompt (reason "tier_hit"), the
gateway asks X for ``kv_tier_export`` and sends Y the lent params, and Y READs the
prefix: ``cached_tokens`` counts it, the text equals X's cold run, both engines pass
check_integrity (no export left pinned) (cluster/disagg/tier_lending.py)."""

from __future__ import annotations

import time

import httpx
import pytest

from tandem.cluster.cli.serve import ServiceThread
from tandem.cluster.cli.settings import serve_config
from tests import shared_ray
from tests.cluster.service_helpers import client, disconnect_mid_stream, wait_idle

pytestmark = [pytest.mark.slow, pytest.mark.shared_ray]


def _wait(what: str, cond, deadline_s: float = 30.0) -> None:
    end = time.monotonic() + deadline_s
    while not cond():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_gateway_lends_a_peer_host_tier_prefix_to_the_chosen_engine():
    config = serve_config(
        model="tiny",
        ray_dashboard=False,
        colocated=2,
        num_kv_blocks=24,  # 384 tokens of device cache each
        max_model_len=256,
        max_num_seqs=4,
        kv_offloading_size=0.01,
        kv_lease_s=10.0,
    )
    assert config.pool_engine("colocated").kv_connector == "nixl"  # tiers + 2 engines: lend
    shared_ray.start()
    try:
        with ServiceThread(config) as svc:
            backend = svc.service.backend
            c = client(svc)
            y, x = sorted(backend.engines)

            def complete(prompt: str, max_tokens: int = 8, salt: str | None = None):
                extra = {"cache_salt": salt} if salt else None
                return c.completions.create(
                    model="tiny",
                    prompt=prompt,
                    max_tokens=max_tokens,
                    temperature=0,
                    extra_body=extra,
                )

            def ready(eid: str) -> bool:
                return backend.engines[eid].state.ready

            def park_in_x_host_tier(prompt: str, salt: str | None):
                """``prompt`` computed cold on x (y drained), then pushed out of x's
                device cache into its host tier; then x drained, y serving."""
                svc.run(backend.drain(y, 30.0))
                first = complete(prompt, salt=salt)
                assert first.usage.prompt_tokens_details.cached_tokens == 0
                for i in range(8):
                    complete(f"Unrelated question {i}. " * 6, max_tokens=2, salt=salt)
                stats = wait_idle(svc)
                full = (first.usage.prompt_tokens - 1) // 16
                assert stats[x].kv_offload.tiers[0].blocks >= full > 0
                _wait("x's host tier in the index", lambda: len(index.hashes_of(x, "host")) >= full)
                _wait("y to know x as a peer", lambda: x in peers_of(y))
                backend.undrain(y)
                _wait("y ready", lambda: ready(y))
                svc.run(backend.drain(x, 30.0))
                return first, full, stats

            def peers_of(eid: str) -> set[str]:
                pushed = backend.engines[eid].pushed_endpoints
                return {ep[0] for ep in pushed[1]} if pushed else set()

            index = backend.routing.index
            prompt = "Tell me about tiered KV caches and who reads them. " * 2
            first, full, stats = park_in_x_host_tier(prompt, None)
            before = stats[y].kv_transfer.transfer_bytes_total
            second = complete(prompt)  # on y, x's host tier lends the prefix
            decisions = backend.routing.decisions()
            assert decisions.get("colocated/tier_hit", 0) >= 1, decisions
            assert decisions.get("tier_lend/lent") == 1, decisions
            assert second.usage.prompt_tokens_details.cached_tokens == full * 16
            assert second.choices[0].text == first.choices[0].text  # as computed cold
            metrics = httpx.get(svc.base_url + "/metrics", timeout=10).text
            assert 'router_decisions_total{reason="lent",role="tier_lend"} 1.0' in metrics
            stats = wait_idle(svc)  # check_integrity on both: no export left pinned
            assert stats[y].kv_transfer.transfer_bytes_total > before  # READ over NIXL
            assert stats[x].kv_transfer.sends_blocks_held == 0
            backend.undrain(x)
            _wait("x ready", lambda: ready(x))

            # lent, then the client goes away: y's abort (or the lease) frees x's pins
            park_in_x_host_tier(prompt, "tenant-b")
            body = dict(model="tiny", prompt=prompt, max_tokens=64, stream=True)
            disconnect_mid_stream(svc, dict(body, cache_salt="tenant-b"), 1)
            assert backend.routing.decisions().get("tier_lend/lent") == 2
            stats = wait_idle(svc, deadline_s=60.0)  # held exports count as busy until freed
            assert stats[x].kv_transfer.sends_blocks_held == 0
            backend.undrain(x)
            _wait("x ready", lambda: ready(x))
    finally:
        shared_ray.release()


def test_decode_engine_prefilling_itself_is_lent_the_prefill_engines_host_tier():
    # 1 prefill (host tier) + 1 decode engine: a max_tokens=1 request prefills on D
    # ("no_prefill"), and P's host tier lends D the prefix P computed earlier
    from tests.cluster.service_helpers import tiny_pd_service

    with tiny_pd_service(
        router="kv-aware",
        prefill_engine={"num_kv_blocks": 32, "kv_offloading_size": 0.01},
        decode_engine={"num_kv_blocks": 32},
    ) as svc:
        backend = svc.service.backend
        c = client(svc)
        (p,) = [eid for eid, e in backend.engines.items() if e.state.role == "prefill"]
        (d,) = [eid for eid, e in backend.engines.items() if e.state.role == "decode"]

        def complete(prompt: str, max_tokens: int):
            return c.completions.create(
                model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0
            )

        prompt = "Tell me about tiered KV caches and who reads them. " * 2
        first = complete(prompt, 8)  # prefilled on P, handed off to D
        for i in range(12):  # out of both device caches; P's blocks stay in its host tier
            complete(f"Unrelated question {i}. " * 6, 2)
        stats = wait_idle(svc)
        full = (first.usage.prompt_tokens - 1) // 16
        assert stats[p].kv_offload.tiers[0].blocks >= full > 0
        index = backend.routing.index
        _wait("P's host tier in the index", lambda: len(index.hashes_of(p, "host")) >= full)
        before = stats[d].kv_transfer.transfer_bytes_total

        second = complete(prompt, 1)  # on D alone, P's host tier lends the prefix
        decisions = backend.routing.decisions()
        assert decisions.get("decode/tier_hit", 0) >= 1, decisions
        assert decisions.get("tier_lend/lent") == 1, decisions
        assert second.usage.prompt_tokens_details.cached_tokens == full * 16
        assert second.choices[0].text and first.choices[0].text.startswith(second.choices[0].text)
        stats = wait_idle(svc)  # check_integrity on both: P's export is over
        assert stats[d].kv_transfer.transfer_bytes_total > before
        assert stats[p].kv_transfer.sends_blocks_held == 0
