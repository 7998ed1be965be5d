"""The real service with n > 1 and the priority policy, through the official
openai client: colocated and prefill/decode give the same choices, each
choice of a seeded request is the request with seed + index, aborts free
every child, and a higher priority overtakes when the engine is saturated."""

from __future__ import annotations

import threading
import time

import pytest

from tandem.cluster.cli.serve import ServiceThread
from tandem.cluster.cli.settings import serve_config
from tests import shared_ray
from tests.cluster.service_helpers import client, disconnect_mid_stream, wait_idle

pytestmark = [pytest.mark.slow, pytest.mark.shared_ray]

# colocated: 2 sequences (children beyond wait) and the priority policy
ENGINE = {"num_kv_blocks": 256, "max_model_len": 1024}
PROMPT = "Parallel sampling forks one prefill into several choices"


def _config(**kw):
    return serve_config(
        model="tiny",
        ray_dashboard=False,
        max_restarts=2,
        **ENGINE,
        max_num_seqs=64,
        colocated_engine={"max_num_seqs": 2, "policy": "priority"},
        **kw,
    )


@pytest.fixture(scope="module")
def services():
    shared_ray.start()
    try:
        with (
            ServiceThread(_config(prefill=1, decode=1, kv_lease_s=5.0)) as disagg,
            ServiceThread(_config(colocated=1)) as colocated,
        ):
            yield disagg, colocated
    finally:
        shared_ray.release()


def texts(svc, n, **kw):
    kw.setdefault("max_tokens", 12)
    r = client(svc).completions.create(
        model="tiny", prompt=PROMPT, n=n, extra_body={"ignore_eos": True}, **kw
    )
    assert [c.index for c in r.choices] == list(range(n))
    assert r.usage.completion_tokens == n * kw["max_tokens"]
    return [c.text for c in r.choices]


def test_n3_greedy_and_seeded_pd_equals_colocated(services):
    disagg, colocated = services
    greedy = texts(colocated, 3, temperature=0)
    assert greedy == [texts(colocated, 1, temperature=0)[0]] * 3
    assert texts(disagg, 3, temperature=0) == greedy
    seeded = texts(colocated, 3, temperature=1.0, seed=42)
    assert len(set(seeded)) == 3
    assert seeded == [texts(colocated, 1, temperature=1.0, seed=42 + i)[0] for i in range(3)]
    assert texts(disagg, 3, temperature=1.0, seed=42) == seeded
    wait_idle(disagg)
    wait_idle(colocated)


@pytest.mark.parametrize("which", [0, 1])
def test_n3_stream_and_chat(services, which):
    svc = services[which]
    c = client(svc)
    chunks = list(
        c.completions.create(
            model="tiny",
            prompt=PROMPT,
            max_tokens=10,
            n=3,
            seed=5,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    streamed = [
        "".join(ch.choices[0].text for ch in chunks if ch.choices and ch.choices[0].index == i)
        for i in range(3)
    ]
    assert streamed == texts(svc, 3, max_tokens=10, seed=5)
    assert chunks[-1].usage.completion_tokens == 30
    chat = c.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=6, n=3, seed=3
    )
    assert [ch.index for ch in chat.choices] == [0, 1, 2]
    wait_idle(svc)


@pytest.mark.parametrize("which", [0, 1])
def test_disconnect_mid_stream_frees_every_child(services, which):
    svc = services[which]
    body = {
        "model": "tiny",
        "prompt": PROMPT * 3,
        "max_tokens": 400,
        "n": 4,
        "stream": True,
        "ignore_eos": True,
    }
    disconnect_mid_stream(svc, body, num_events=6)
    wait_idle(svc)


def test_priority_overtakes_when_saturated(services):
    _, colocated = services
    c = client(colocated)
    finished: list[str] = []

    def send(name, priority, max_tokens):
        c.completions.create(
            model="tiny",
            prompt=PROMPT,
            max_tokens=max_tokens,
            extra_body={"ignore_eos": True, "priority": priority},
        )
        finished.append(name)

    def waiting():
        stats = colocated.run(colocated.service.backend.call_all("stats"))
        return sum(s.scheduler.num_waiting_reqs for s in stats.values())

    threads = [threading.Thread(target=send, args=(f"busy{i}", 5, 300)) for i in range(2)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while (
        sum(
            s.scheduler.num_running_reqs
            for s in colocated.run(colocated.service.backend.call_all("stats")).values()
        )
        < 2
    ):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    low = threading.Thread(target=send, args=("low", 9, 4))
    low.start()
    threads.append(low)
    while waiting() < 1:  # "low" queued behind the two busy ones
        assert time.monotonic() < deadline
        time.sleep(0.02)
    high = threading.Thread(target=send, args=("high", -1, 4))
    high.start()
    threads.append(high)
    for t in threads:
        t.join(120)
    assert sorted(finished) == ["busy0", "busy1", "high", "low"]
    assert finished.index("high") < finished.index("low")
    assert finished[0] == "high"  # it preempted a busy one and ran at once
    wait_idle(colocated)


def test_pd_prefills_once_reads_once_and_decode_forks(services):
    disagg, _ = services

    def by_role():
        stats = disagg.run(disagg.service.backend.call_all("stats"))
        return {s.role: s for s in stats.values()}

    before = by_role()
    r = client(disagg).completions.create(
        model="tiny",
        prompt="A prompt nobody sent before, forked on the decode engine",
        max_tokens=5,
        n=4,
        seed=1,
        extra_body={"ignore_eos": True},
    )
    after = by_role()
    num_prompt = r.usage.prompt_tokens
    assert r.usage.completion_tokens == 20
    # P computed the prompt but its last token, once; D computed that token per child
    p_delta = (
        after["prefill"].scheduler.num_prompt_tokens - before["prefill"].scheduler.num_prompt_tokens
    )
    d_delta = (
        after["decode"].scheduler.num_prompt_tokens - before["decode"].scheduler.num_prompt_tokens
    )
    assert (p_delta, d_delta) == (num_prompt - 1, 4)

    def read_bytes(s):
        return s.kv_transfer.transfer_bytes_total

    assert read_bytes(after["decode"]) > read_bytes(before["decode"])
    wait_idle(disagg)


def test_stop_string_aborts_only_its_choice(services):
    _, colocated = services
    c = client(colocated)
    kw = dict(model="tiny", prompt=PROMPT, n=2, seed=9, extra_body={"ignore_eos": True})
    full = c.completions.create(max_tokens=200, **kw)
    first, second = (ch.text for ch in full.choices)
    # a stop string early in choice 0 and nowhere in choice 1
    stop = next(
        first[i : i + 4]
        for i in range(4, 20)
        if first[i : i + 4] not in second and first[i : i + 4] not in first[:i]
    )

    def generated():
        stats = colocated.run(colocated.service.backend.call_all("stats"))
        return sum(s.scheduler.num_generation_tokens for s in stats.values())

    before = generated()
    r = c.completions.create(max_tokens=200, stop=[stop], **kw)
    assert r.choices[0].finish_reason == "stop" and stop not in r.choices[0].text
    assert first.startswith(r.choices[0].text)
    assert (r.choices[1].text, r.choices[1].finish_reason) == (second, "length")
    wait_idle(colocated)
    # choice 0's child was aborted on the engine, not run to 200 tokens
    assert generated() - before < 200 + 60
