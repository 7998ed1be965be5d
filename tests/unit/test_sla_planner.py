"""cluster/planner/sla.py: the engine counts, checked against hand arithmetic."""

from __future__ import annotations

import math

import pytest

from tandem.cluster.planner.profile import Profile, TransferCost
from tandem.cluster.planner.sla import Load, decide, decode_itl_p90_s, prefill_ttft_p90_s, required


def profile() -> Profile:
    # prefill: 0.1 s for any prompt; decode: 0.01 + 0.001 * batch size s,
    # whatever the context; handoff 5 ms flat
    return Profile(
        prefill_tokens=[1, 10000],
        prefill_time_s=[0.1, 0.1],
        decode_batch_sizes=[1, 101],
        decode_context_tokens=[1, 1_000_000],
        decode_time_s=[[0.011, 0.011], [0.111, 0.111]],
        transfer=TransferCost(bytes_per_s=1e9, latency_s=0.005, kv_bytes_per_token=0),
        scheduler={"max_num_seqs": 256},
    )


LOAD = Load(rate=20.0, prompt_tokens=512, output_tokens=100)


def test_prefill_batches_queued_prompts_into_full_steps():
    """A GPU-like profile (a step's cost mostly fixed up to 2048 tokens): queued prompts
    share steps of max_num_batched_tokens, so an engine serves many more prompts/s than
    one prompt per step; the TTFT still includes a prompt's own step."""
    gpu = Profile(
        prefill_tokens=[128, 2048, 8192],
        prefill_time_s=[0.012, 0.0125, 0.051],
        decode_batch_sizes=[1, 256],
        decode_context_tokens=[1, 1_000_000],
        decode_time_s=[[0.001, 0.001], [0.005, 0.005]],
        transfer=TransferCost(bytes_per_s=1e9, latency_s=0.005, kv_bytes_per_token=0),
        scheduler={"max_num_seqs": 256, "max_num_batched_tokens": 8192},
    )
    load = Load(rate=300.0, prompt_tokens=256, output_tokens=512)
    share = 256 * 0.051 / 8192  # 1.6 ms of a full step, not its own step's 12 ms
    rho = 300.0 * share / 1
    want = share * math.log(10 * rho) / (1 - rho) + gpu.prefill_s(256)
    assert prefill_ttft_p90_s(load, gpu, 1) == pytest.approx(want)
    pre, _ = required(load, gpu, ttft_slo_ms=1000.0, itl_slo_ms=15.0)
    assert pre.engines == 1  # one prompt per step would need 300 * 0.012 = 3.6 engines
    # without a batch budget in the profile, a prompt costs its own step (the old model)
    alone = Profile(**{**gpu.__dict__, "scheduler": {"max_num_seqs": 256}})
    assert prefill_ttft_p90_s(load, alone, 3) == math.inf


def test_prefill_count_matches_hand_arithmetic():
    # rho = 20 * 0.1 / N; wait p90 = 0.1 * ln(10 rho) / (1 - rho);
    # TTFT p90 = wait + 0.1 (prefill; P's sampled token is streamed at once)
    def hand(n):
        rho = 2.0 / n
        return 0.1 * math.log(10 * rho) / (1 - rho) + 0.1

    assert prefill_ttft_p90_s(LOAD, profile(), 2) == math.inf  # rho = 1
    for n in (3, 4, 5, 6):
        assert prefill_ttft_p90_s(LOAD, profile(), n) == pytest.approx(hand(n))
    assert hand(5) > 0.3 >= hand(6)  # 0.331 s, then 0.281 s
    pre, _ = required(LOAD, profile(), ttft_slo_ms=300, itl_slo_ms=25)
    assert (pre.engines, pre.feasible) == (6, True)
    assert pre.p90_ms == pytest.approx(hand(6) * 1000)


def test_decode_count_matches_hand_arithmetic():
    # Little: c = (20 / N * 100) * itl, itl = 0.01 + 0.001 c
    #   => c = 0.01 k / (1 - 0.001 k) with k = 2000 / N
    def hand(n):
        k = 2000 / n
        c = 0.01 * k / (1 - 0.001 * k)
        return 0.01 + 0.001 * c

    assert decode_itl_p90_s(LOAD, profile(), 2) == math.inf  # k = 1000: no fixed point
    assert hand(3) == pytest.approx(0.030) and hand(4) == pytest.approx(0.020)
    for n in (3, 4, 5):
        assert decode_itl_p90_s(LOAD, profile(), n) == pytest.approx(hand(n))
    _, dec = required(LOAD, profile(), ttft_slo_ms=300, itl_slo_ms=25)
    assert (dec.engines, dec.feasible) == (4, True)


def test_over_max_reports_infeasible_at_max():
    pre, dec = required(LOAD, profile(), 300, 25, max_engines=(4, 3))
    assert (pre.engines, pre.feasible) == (4, False)
    assert (dec.engines, dec.feasible) == (3, False)


def test_zero_traffic_scales_in_to_the_minimum():
    idle = Load(rate=0.0, prompt_tokens=0, output_tokens=0)
    pre, dec = required(idle, profile(), 300, 25, min_engines=(2, 1))
    assert (pre.engines, dec.engines) == (2, 1)
    assert decide(idle, profile(), 300, 25, current=(6, 4), min_engines=(2, 1)) == (2, 1)


def _edge_rate() -> float:
    """The lowest rate (to 1e-4) at which the prefill pool needs 6 engines, not 5."""
    lo, hi = 1.0, 20.0
    while hi - lo > 1e-4:
        mid = (lo + hi) / 2
        n = required(Load(mid, 512, 100), profile(), 300, 1000)[0].engines
        lo, hi = (mid, hi) if n <= 5 else (lo, mid)
    return hi


def test_steady_load_at_the_edge_does_not_oscillate():
    edge = _edge_rate()
    # the prediction wobbles +-2% around the edge
    rates = [edge * (1.02 if i % 2 == 0 else 0.98) for i in range(12)]
    needs = [required(Load(r, 512, 100), profile(), 300, 1000)[0].engines for r in rates]
    assert set(needs) == {5, 6}  # the bare minimum flips every interval...
    cur, seen = (5, 1), []
    for r in rates:
        cur = decide(Load(r, 512, 100), profile(), 300, 1000, current=cur)
        seen.append(cur[0])
    assert seen == [6] * 12  # ...the planner scales out once and stays
    # without a margin it would flip, which is the failure mode being guarded
    cur, flips = (5, 1), []
    for r in rates:
        cur = decide(Load(r, 512, 100), profile(), 300, 1000, current=cur, scale_in_margin=0)
        flips.append(cur[0])
    assert flips == needs


def test_scale_in_leaves_each_survivor_under_the_slo_at_n_over_n_minus_1():
    p = profile()
    cur = (10, 1)
    for rate in (18.0, 15.0, 12.0, 9.0, 6.0, 3.0):
        new = decide(Load(rate, 512, 100), p, 300, 1000, current=cur)
        if new[0] < cur[0]:
            # the survivors carry rate / new[0] each, and still meet the SLO with the margin
            assert prefill_ttft_p90_s(Load(rate * 1.1, 512, 100), p, new[0]) <= 0.3
        cur = new
    assert cur[0] < 10  # it did scale in as the load fell


def test_bad_input_names_the_field():
    with pytest.raises(ValueError, match="--ttft-slo-ms"):
        required(LOAD, profile(), 0, 25)
    with pytest.raises(ValueError, match="--itl-slo-ms"):
        required(LOAD, profile(), 300, -1)
    with pytest.raises(ValueError, match="rate"):
        required(Load(-1, 1, 1), profile(), 300, 25)
    with pytest.raises(ValueError, match="min"):
        required(LOAD, profile(), 300, 25, min_engines=(3, 1), max_engines=(2, 2))
