"""A prefix only another engine's host KV tier holds, lent by the gateway (real Ray, real
NIXL over UCX loopback, two colocated tiny engines with host tiers, openai client):
engine X computed the prompt and pushed it out of its small device cache into its host
tier; with X drained, the router picks Y for the same prompt (reason "tier_hit"), the
gateway asks X for ``kv_tier_export`` and sends Y the lent params, and Y READs the
prefix: ``cached_tokens`` counts it, the text equals X's cold run, both engines pass
check_integrity (no export left pinned) (cluster/disagg/tier_lending.py). Under P/D
(1 prefill + 2 decode engines, each with a host tier) the lending goes every way:
prefill -> decode, decode -> decode, and decode -> the prefill engine before it
prefills."""

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
    assert (
        config.pool_engine("colocated").kv_transfer.connector == "nixl"
    )  # tiers + 2 engines: lend
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


def test_pd_engines_lend_their_host_tiers_to_each_other():
    """1 prefill + 2 decode engines, each with a host tier (kv role "both"): D is lent
    P's tier when it computes the prompt itself; D is lent the other D's tier when the
    plan counts the tiers as holding the prompt ("tiers_hold_prompt"); the prefill
    engine borrows a decode engine's tier before it prefills, and computes only the
    rest (cached tokens = the lent blocks); a client gone mid-stream leaves no pin."""
    config = serve_config(
        model="tiny",
        ray_dashboard=False,
        prefill=1,
        decode=2,
        disagg_min_tokens=32,
        num_kv_blocks=64,
        max_num_seqs=4,
        max_model_len=512,
        kv_offloading_size=0.01,
        kv_lease_s=10.0,
    )
    shared_ray.start()
    try:
        with ServiceThread(config) as svc:
            backend = svc.service.backend
            index = backend.routing.index
            c = client(svc)
            (p,) = [eid for eid, e in backend.engines.items() if e.state.role == "prefill"]
            d0, d1 = sorted(eid for eid, e in backend.engines.items() if e.state.role == "decode")
            infos = {eid: e.state.info for eid, e in backend.engines.items()}
            assert all(info["kv_role"] == "both" for info in infos.values()), infos

            def complete(prompt: str, max_tokens: int = 8, salt: str | None = None):
                extra = {"cache_salt": salt} if salt else None
                return c.completions.create(
                    model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0,
                    extra_body=extra,
                )  # fmt: skip

            def peers_of(eid: str) -> set[str]:
                pushed = backend.engines[eid].pushed_endpoints
                return {ep[0] for ep in pushed[1]} if pushed else set()

            def reset(eid: str) -> None:
                """``eid`` forgets every prefix, device and tiers (the index hears it)."""

                async def call():
                    return await backend.engines[eid].handle.actor.reset_prefix_cache.remote()

                wait_idle(svc)
                assert svc.run(call()) is True
                _wait(f"{eid}'s tiers empty in the index", lambda: not index.hashes_of(eid, "host"))

            def held(eid: str, num_blocks: int) -> None:
                _wait(
                    f"{eid}'s host tier in the index",
                    lambda: len(index.hashes_of(eid, "host")) >= num_blocks,
                )

            def lent() -> int:
                return backend.routing.decisions().get("tier_lend/lent", 0)

            every = {p, d0, d1}
            _wait("peers known", lambda: all(every <= peers_of(e) for e in every))
            prompt = "Tell me about tiered KV caches and who reads them. " * 2
            svc.run(backend.drain(d0, 30.0))
            first = complete(prompt)  # P prefills, d1 decodes: both tiers store the prompt
            assert first.usage.prompt_tokens_details.cached_tokens == 0
            full = (first.usage.prompt_tokens - 1) // 16
            held(p, full), held(d1, full)

            # D computes the prompt (max_tokens=1: no P), P's host tier lends it
            reset(d1)
            one = complete(prompt, max_tokens=1)
            assert lent() == 1, backend.routing.decisions()
            assert one.usage.prompt_tokens_details.cached_tokens == full * 16
            assert first.choices[0].text.startswith(one.choices[0].text)
            held(d1, full)

            # decode <-> decode: d0 (d1 drained) counts d1's tier as holding the prompt
            reset(p)
            backend.undrain(d0)
            _wait("d0 ready", lambda: backend.engines[d0].state.ready)
            svc.run(backend.drain(d1, 30.0))
            before = wait_idle(svc)[d0].kv_transfer.transfer_bytes_total
            second = complete(prompt)
            decisions = backend.routing.decisions()
            assert decisions.get("route/tiers_hold_prompt") == 1, decisions
            assert lent() == 2, decisions
            assert second.usage.prompt_tokens_details.cached_tokens == full * 16
            assert second.choices[0].text == first.choices[0].text
            stats = wait_idle(svc)  # check_integrity everywhere: d1's export is over
            assert stats[d0].kv_transfer.transfer_bytes_total > before  # READ from d1
            assert stats[d1].kv_transfer.sends_blocks_held == 0

            # P borrows before it prefills: the prompt plus a new part worth a prefill
            longer = prompt + "Now compare them with a single device cache, please. " * 3
            cold = complete(longer, salt="cold")  # the same tokens, computed cold
            assert cold.usage.prompt_tokens_details.cached_tokens == 0
            reset(p)  # P holds nothing of it; d0's and d1's host tiers hold the prompt
            third = complete(longer)
            decisions = backend.routing.decisions()
            assert lent() == 3, decisions
            assert third.usage.prompt_tokens_details.cached_tokens == full * 16  # on P
            assert third.choices[0].text == cold.choices[0].text
            metrics = httpx.get(svc.base_url + "/metrics", timeout=10).text
            assert 'router_decisions_total{reason="lent",role="tier_lend"} 3.0' in metrics
            stats = wait_idle(svc)
            assert all(s.kv_transfer.sends_blocks_held == 0 for s in stats.values())

            # lent to P, then the client goes away: every pin and held block is freed
            reset(p)  # a new second part: d0 holds only the prompt's blocks again
            other = prompt + "Then explain why a peer would lend its host tier. " * 3
            body = dict(model="tiny", prompt=other, max_tokens=64, stream=True)
            disconnect_mid_stream(svc, body, 1)
            assert lent() == 4, backend.routing.decisions()
            stats = wait_idle(svc, deadline_s=60.0)
            assert all(s.kv_transfer.sends_blocks_held == 0 for s in stats.values())
            backend.undrain(d1)
    finally:
        shared_ray.release()


def test_a_prefill_engine_without_a_tier_borrows_the_decode_engines():
    """Only the decode pool keeps a host tier (a common deployment): the prefill engine
    runs NIXL as "both" all the same (``kv_borrows_tiers``), so it is pushed its peers
    and lent D's tier before it prefills: ``cached_tokens`` = the lent blocks, the text
    of a cold run, the plan scoring P's borrowable prefix ("tier_hit"); a client gone
    mid-stream after a lend leaves nothing pinned or held on either engine."""
    config = serve_config(
        model="tiny",
        ray_dashboard=False,
        prefill=1,
        decode=1,
        disagg_min_tokens=32,
        num_kv_blocks=64,
        max_num_seqs=4,
        max_model_len=512,
        decode_engine={"kv_offloading_size": 0.01},
        kv_lease_s=10.0,
        router="kv-aware",  # one engine per pool would route least-load
    )
    assert config.pool_engine("prefill").offload.kv_offloading_size is None
    shared_ray.start()
    try:
        with ServiceThread(config) as svc:
            backend = svc.service.backend
            index = backend.routing.index
            c = client(svc)
            (p,) = [eid for eid, e in backend.engines.items() if e.state.role == "prefill"]
            (d,) = [eid for eid, e in backend.engines.items() if e.state.role == "decode"]
            assert backend.engines[p].state.info["kv_role"] == "both"

            def complete(prompt: str, max_tokens: int = 8, salt: str | None = None):
                extra = {"cache_salt": salt} if salt else None
                return c.completions.create(
                    model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0,
                    extra_body=extra,
                )  # fmt: skip

            def reset_p() -> None:
                async def call():
                    return await backend.engines[p].handle.actor.reset_prefix_cache.remote()

                wait_idle(svc)
                assert svc.run(call()) is True
                _wait("P's blocks gone from the index", lambda: not index.hashes_of(p))

            def lent() -> int:
                return backend.routing.decisions().get("tier_lend/lent", 0)

            pushed = lambda: backend.engines[p].pushed_endpoints  # noqa: E731
            _wait("P to know D as a peer", lambda: pushed() and d in {ep[0] for ep in pushed()[1]})
            prompt = "Tell me about tiered KV caches and who reads them. " * 2
            first = complete(prompt)  # P prefills, D decodes: D's host tier stores it
            full = (first.usage.prompt_tokens - 1) // 16
            _wait("D's host tier in the index", lambda: len(index.hashes_of(d, "host")) >= full)
            assert not index.hashes_of(p, "host")  # P keeps no tier

            longer = prompt + "Now compare them with a single device cache, please. " * 3
            cold = complete(longer, salt="cold")  # the same tokens, computed cold
            assert cold.usage.prompt_tokens_details.cached_tokens == 0
            reset_p()  # P holds nothing of it; D's host tier holds the prompt
            before = wait_idle(svc)[p].kv_transfer.transfer_bytes_total
            third = complete(longer)
            decisions = backend.routing.decisions()
            assert decisions.get("route/remote_prefill", 0) >= 3, decisions
            assert decisions.get("prefill/tier_hit", 0) >= 1, decisions  # the plan saw it
            assert lent() == 1, decisions
            assert third.usage.prompt_tokens_details.cached_tokens == full * 16  # on P
            assert third.choices[0].text == cold.choices[0].text
            stats = wait_idle(svc)  # check_integrity on both
            assert stats[p].kv_transfer.transfer_bytes_total > before  # READ from D's tier
            assert all(s.kv_transfer.sends_blocks_held == 0 for s in stats.values())

            # lent to P, then the client goes away: every pin and held block is freed
            reset_p()
            other = prompt + "Then explain why a peer would lend its host tier. " * 3
            body = dict(model="tiny", prompt=other, max_tokens=64, stream=True)
            disconnect_mid_stream(svc, body, 1)
            assert lent() == 2, backend.routing.decisions()
            stats = wait_idle(svc, deadline_s=60.0)
            assert all(s.kv_transfer.sends_blocks_held == 0 for s in stats.values())
    finally:
        shared_ray.release()
