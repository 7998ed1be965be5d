"""The overlapped loop (``async_scheduling``) gives the synchronous loop's outputs.

Every scenario runs the same requests through an engine with and without the flag and
compares each request's tokens, logprobs and finish reason exactly (the tiny model in
fp32; both loops run the same kernels on the same batches of one request's positions),
then checks both engines' integrity.
"""

from __future__ import annotations

import argparse
import threading

import pytest
import torch

from tandem.wire.engine_protocol import EngineOutput, EngineRequest, FinishReason, SamplingParams
from tandem.workers.config import EngineConfig, add_engine_arguments, engine_overrides
from tandem.workers.engine.core import EngineCore
from tandem.workers.engine.llm import LLM
from tandem.workers.runner.async_step import StepStream
from tests.workers import hf_checkpoints
from tests.workers import test_piecewise_graphs as piecewise_tests
from tests.workers.test_decode_graphs import PROMPTS, _with_graphs

Key = tuple[str, int]  # (request id, choice index)


class Result:
    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.logprobs: list = []
        self.prompt_logprobs = None
        self.finish_reason = None
        self.stop_reason = None

    def as_tuple(self) -> tuple:
        return (
            self.tokens,
            self.logprobs,
            self.prompt_logprobs,
            self.finish_reason,
            self.stop_reason,
        )


def _prompts(lens: list[int], seed: int = 1, vocab: int = 250) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lens]


def run(
    model: str,
    requests: list[EngineRequest],
    *,
    async_scheduling: bool,
    abort_at: dict[str, int] | None = None,
    eos_token_id: int | None = None,
    inline_stream: bool = False,
    **config,
) -> tuple[dict[Key, Result], EngineCore]:
    """Step an engine until idle. ``abort_at``: abort a request between steps once it
    has this many output tokens. ``eos_token_id``: the engine's EOS, for both loops.
    ``inline_stream``: the overlapped loop's steps run inline, as on CUDA."""
    config.setdefault("num_kv_blocks", 64)
    config.setdefault("block_size", 4)
    config.setdefault("max_num_batched_tokens", 32)
    engine = EngineCore(
        EngineConfig.from_flat(model=model, async_scheduling=async_scheduling, **config)
    )
    if eos_token_id is not None:
        engine.eos_token_id = engine.runner.eos_token_id = eos_token_id
    if inline_stream:
        engine.runner.stream.close()
        engine.runner.stream = StepStream(threaded=False)
    results: dict[Key, Result] = {}
    for req in requests:
        assert engine.add_request(req) is None
    abort_at = dict(abort_at or {})
    num_steps = 0
    while engine.has_work():
        num_steps += 1
        assert num_steps < 2000, "the engine does not finish"
        out: EngineOutput
        for out in engine.step().outputs:
            r = results.setdefault((out.request_id, out.index), Result())
            assert r.finish_reason is None, f"{out.request_id} got output after finishing"
            r.tokens += out.new_token_ids
            r.logprobs += out.new_logprobs or []
            if out.prompt_logprobs is not None:
                r.prompt_logprobs = out.prompt_logprobs
            r.finish_reason = out.finish_reason
            r.stop_reason = out.stop_reason
        for rid, num in list(abort_at.items()):
            if len(results.get((rid, 0), Result()).tokens) >= num:
                engine.abort([rid])
                results[(rid, 0)].finish_reason = "aborted here"
                del abort_at[rid]
        if async_scheduling:
            engine.scheduler.check_integrity(idle=False)
    engine.check_integrity()
    engine.runner.extras.check_integrity()
    assert all(not st.pending for st in engine.runner.requests.values())
    engine.shutdown()
    return results, engine


def same_outputs(
    model: str, requests: list[EngineRequest], **kwargs
) -> tuple[dict[Key, Result], EngineCore]:
    """Both loops' outputs are equal: (them, the overlapped engine, shut down)."""
    sync, sync_engine = run(model, requests, async_scheduling=False, **kwargs)
    overlapped, engine = run(model, requests, async_scheduling=True, **kwargs)
    assert engine.overlap is not None and sync_engine.overlap is None
    assert sorted(overlapped) == sorted(sync)
    for key, r in sync.items():
        assert overlapped[key].as_tuple() == r.as_tuple(), key
    return sync, engine


def _req(rid: str, prompt: list[int], **params) -> EngineRequest:
    n = params.pop("n", 1)
    return EngineRequest(rid, prompt, SamplingParams(**params), n=n)


def test_mixed_sampling_chunked_prefill_and_logprobs(tiny_model_dir):
    """Greedy, seeded and unseeded random rows, top-k/top-p/min-p, logprobs and prompt
    logprobs, max_tokens from 1 up, prompts longer than the step budget (chunked)."""
    prompts = _prompts([1, 5, 40, 77, 9, 30, 3, 18])
    kinds = [
        dict(temperature=0.0),
        dict(temperature=0.9, seed=11),
        dict(temperature=1.0),
        dict(temperature=0.7, top_p=0.8, logprobs=3),
        dict(temperature=1.2, top_k=20, seed=5, prompt_logprobs=2),
        dict(temperature=0.8, min_p=0.05),
        dict(temperature=1.0, logprobs=0),
        dict(temperature=0.0, prompt_logprobs=0),
    ]
    requests = [
        _req(f"r{i}", p, max_tokens=1 + (3 * i) % 13, ignore_eos=True, **kind)
        for i, (p, kind) in enumerate(zip(prompts, kinds))
    ]
    results, _ = same_outputs(tiny_model_dir, requests)
    assert [len(results[(f"r{i}", 0)].tokens) for i in range(8)] == [
        1 + (3 * i) % 13 for i in range(8)
    ]
    assert results[("r4", 0)].prompt_logprobs is not None


def test_stop_tokens_eos_and_aborts_mid_batch(tiny_model_dir):
    """Requests that stop (stop token, EOS) or are aborted while their next step is
    already scheduled: that step's token is dropped, their batch mates are unaffected."""
    prompts = _prompts([6, 11, 4, 25, 8, 13])
    free = [_req(f"r{i}", p, max_tokens=12, temperature=0.0, ignore_eos=True)
            for i, p in enumerate(prompts)]  # fmt: skip
    plain, _ = run(tiny_model_dir, free, async_scheduling=False)
    stop_at = {rid: r.tokens[3] for (rid, _), r in plain.items()}  # 4th greedy token
    eos = plain[("r2", 0)].tokens[2]
    requests = [
        _req("r0", prompts[0], max_tokens=12, temperature=0.0, stop_token_ids=[stop_at["r0"]],
             ignore_eos=True),
        _req("r1", prompts[1], max_tokens=12, temperature=0.9, seed=3, ignore_eos=True),
        _req("r2", prompts[2], max_tokens=12, temperature=0.0),  # stops on "EOS"
        _req("r3", prompts[3], max_tokens=12, temperature=1.0, ignore_eos=True),
        _req("r4", prompts[4], max_tokens=12, temperature=0.0, ignore_eos=True),
        _req("r5", prompts[5], max_tokens=12, temperature=0.0, ignore_eos=True,
             stop_token_ids=[stop_at["r5"]], min_tokens=5),
    ]  # fmt: skip
    results, _ = same_outputs(
        tiny_model_dir, requests, eos_token_id=eos, abort_at={"r3": 2, "r4": 5}
    )
    assert results[("r0", 0)].stop_reason == stop_at["r0"]
    assert (
        results[("r2", 0)].finish_reason == FinishReason.STOP
        and results[("r2", 0)].tokens[-1] == eos
    )
    assert len(results[("r3", 0)].tokens) == 2 and len(results[("r4", 0)].tokens) == 5
    assert len(results[("r1", 0)].tokens) == 12


def test_preemption_under_a_small_kv_cache(tiny_model_dir):
    prompts = _prompts([10, 14, 7, 12, 9, 11])
    requests = [
        _req(f"r{i}", p, max_tokens=14, temperature=0.0 if i % 2 else 0.8, seed=i,
             ignore_eos=True)
        for i, p in enumerate(prompts)
    ]  # fmt: skip
    _, engine = same_outputs(tiny_model_dir, requests, num_kv_blocks=14)
    assert engine.scheduler.num_preemptions > 0


def test_prefix_hits_and_forks(tiny_model_dir):
    """Shared prefixes (hits on blocks the other loop may still be computing) and n > 1
    requests (the children copy a block the parent's prefill step wrote)."""
    shared = _prompts([21])[0]
    tails = _prompts([3, 6, 1, 9], seed=2)
    requests = [
        _req(f"p{i}", shared + t, max_tokens=6, temperature=0.0, ignore_eos=True)
        for i, t in enumerate(tails)
    ]
    requests += [
        _req("fork-seeded", shared + [7, 8], n=3, max_tokens=7, temperature=1.0, seed=9),
        _req("fork-free", tails[1] + shared, n=2, max_tokens=5, temperature=0.8),
        _req("fork-greedy", shared[:10], n=2, max_tokens=4, temperature=0.0, ignore_eos=True),
    ]
    results, engine = same_outputs(tiny_model_dir, requests)
    assert {i for rid, i in results if rid == "fork-seeded"} == {0, 1, 2}
    assert engine.scheduler.prefix_cache_hits > 0


def test_penalties_bias_and_bad_words(tiny_model_dir):
    """Rows whose logits depend on their own earlier tokens, next to plain rows."""
    prompts = _prompts([8, 12, 5, 16])
    requests = [
        _req("pen", prompts[0], max_tokens=10, temperature=0.0, repetition_penalty=1.3,
             frequency_penalty=0.5, presence_penalty=0.4, ignore_eos=True),
        _req("bias", prompts[1], max_tokens=10, temperature=0.9, seed=4,
             logit_bias={5: 4.0, 17: -100.0}, ignore_eos=True),
        _req("bad", prompts[2], max_tokens=10, temperature=0.0, ignore_eos=True,
             bad_words_token_ids=[[prompts[2][0]], [60, 61]]),
        _req("plain", prompts[3], max_tokens=10, temperature=1.0, ignore_eos=True),
    ]  # fmt: skip
    same_outputs(tiny_model_dir, requests)


def test_steps_overlap_on_the_step_thread(tiny_model_dir):
    """The next step is scheduled and launched before the previous step's tokens are read,
    and the forward runs on the step stream's thread."""
    engine = EngineCore(
        EngineConfig.from_flat(
            model=tiny_model_dir, num_kv_blocks=32, block_size=4, async_scheduling=True
        )
    )
    threads: set[str] = set()
    forward = engine.model.forward

    def recording_forward(*args, **kwargs):
        threads.add(threading.current_thread().name)
        return forward(*args, **kwargs)

    engine.model.forward = recording_forward
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    engine.add_request(EngineRequest("a", [5, 6, 7], params))
    first = engine.step()  # schedules and launches the prefill: nothing to show yet
    assert first.outputs == [] and engine.scheduler.num_steps_in_flight == 1
    second = engine.step()  # launches the first decode, then applies the prefill
    assert [o.new_token_ids for o in second.outputs] == [[second.outputs[0].new_token_ids[0]]]
    assert engine.scheduler.num_steps_in_flight == 1
    assert engine.scheduler.requests["a"].num_output_placeholders == 1
    while engine.has_work():
        engine.step()
    engine.check_integrity()
    engine.shutdown()
    assert threads and all(name.startswith("tandem-step") for name in threads), threads


def test_flag():
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    assert engine_overrides(parser.parse_args(["--async-scheduling"])) == {"async_scheduling": True}
    assert engine_overrides(parser.parse_args([])) == {}
    assert engine_overrides(parser.parse_args(["--no-async-scheduling"])) == {
        "async_scheduling": False
    }
    # auto (None): on with CUDA (the H200 decode rows), off on CPU; an explicit value wins
    assert EngineConfig.from_flat().scheduler.async_scheduling is None
    assert not EngineConfig.from_flat().uses_async_scheduling()
    assert EngineConfig.from_flat(device="cuda").uses_async_scheduling()
    assert EngineConfig.from_flat(device="cuda:1").uses_async_scheduling()
    assert not EngineConfig.from_flat(device="cuda", async_scheduling=False).uses_async_scheduling()
    assert EngineConfig.from_flat(async_scheduling=True).uses_async_scheduling()


def test_unseeded_draws_do_not_depend_on_batch_mates(tiny_model_dir):
    """An unseeded request draws from its own stream: alone or in a batch, same tokens."""
    seed = 7  # the engine's
    prompt = _prompts([9])[0]
    alone, _ = run(tiny_model_dir, [_req("x", prompt, max_tokens=8, temperature=1.0)],
                   async_scheduling=False, seed=seed)  # fmt: skip
    crowd = [_req(f"o{i}", p, max_tokens=3 + i, temperature=1.0)
             for i, p in enumerate(_prompts([4, 7, 2]))]  # fmt: skip
    together, _ = run(tiny_model_dir, [*crowd, _req("x", prompt, max_tokens=8, temperature=1.0)],
                      async_scheduling=True, seed=seed)  # fmt: skip
    assert together[("x", 0)].tokens == alone[("x", 0)].tokens


def test_an_id_reused_after_a_stop_gets_none_of_the_old_tokens(tiny_model_dir):
    """A request stops while its next step is in flight and a new request takes its id
    before that step's output is applied: the old request's token is dropped, not given
    to the new one."""
    prompt = _prompts([7])[0]
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    free, _ = run(tiny_model_dir, [EngineRequest("a", prompt, greedy)], async_scheduling=False)
    stop = free[("a", 0)].tokens[2]
    engine = EngineCore(
        EngineConfig.from_flat(
            model=tiny_model_dir, num_kv_blocks=32, block_size=4, async_scheduling=True
        )
    )
    first = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, stop_token_ids=[stop])
    engine.add_request(EngineRequest("a", prompt, first))
    outputs: list[list[int]] = [[]]
    reused = False
    while engine.has_work():
        for out in engine.step().outputs:
            outputs[-1] += out.new_token_ids
            if out.finish_reason is not None and not reused:
                reused = True
                outputs.append([])
                engine.add_request(EngineRequest("a", [9, 9, 9], greedy))
    engine.check_integrity()
    engine.shutdown()
    alone, _ = run(tiny_model_dir, [EngineRequest("a", [9, 9, 9], greedy)], async_scheduling=False)
    assert outputs == [free[("a", 0)].tokens[:3], alone[("a", 0)].tokens]


@pytest.fixture
def triton_llama(tmp_path, monkeypatch) -> str:
    """A one-layer Llama on the paged Triton kernels (interpreted on CPU), as the graph
    runner's tests use."""
    monkeypatch.setenv("TANDEM_FORCE_TRITON", "1")
    return hf_checkpoints.make_checkpoint("llama", tmp_path, num_hidden_layers=1)


def test_decode_graph_replays_read_the_tokens_in_flight(triton_llama):
    """Replayed decode steps (the graph runner, eager backend on CPU) take the previous
    step's tokens from the device through ``patch_ids``: same tokens as eager."""
    params = [
        SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=6, temperature=1.0, seed=2, ignore_eos=True),
    ] * 2
    eager = _graph_llm(triton_llama, False).generate(
        prompt_token_ids=PROMPTS, sampling_params=params
    )
    llm = _graph_llm(triton_llama, True)
    graphs = _with_graphs(llm, [1, 2, 4])
    replayed = llm.generate(prompt_token_ids=PROMPTS, sampling_params=params)
    assert [r.token_ids for r in replayed] == [r.token_ids for r in eager]
    assert graphs.num_replays[4] > 0
    llm.engine.check_integrity()
    llm.close()


def test_piecewise_replays_read_the_tokens_in_flight(tmp_path):
    """Mixed steps replayed in pieces (eager backend on CPU): a decode whose token is in
    flight next to a prefill chunk gets it through ``patch_ids``; same tokens as eager."""
    path = hf_checkpoints.make_checkpoint("llama", tmp_path, num_hidden_layers=2)
    prompts = [*piecewise_tests.PROMPTS, [7] * 21]
    params = [SamplingParams(max_tokens=5, temperature=1.0, seed=i, ignore_eos=True)
              for i in range(len(prompts))]  # fmt: skip
    eager = _graph_llm(path, False, 48).generate(prompt_token_ids=prompts, sampling_params=params)
    llm = _graph_llm(path, True, 48)
    graphs = piecewise_tests._with_graphs(llm, "piecewise", [4, 8, 16])
    replayed = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    assert [r.token_ids for r in replayed] == [r.token_ids for r in eager]
    assert sum(graphs.piecewise.num_replays.values()) > 0
    llm.engine.check_integrity()
    llm.close()


def _graph_llm(path: str, async_scheduling: bool, num_kv_blocks: int = 32) -> LLM:
    return LLM(
        EngineConfig.from_flat(
            model=path,
            block_size=4,
            max_num_seqs=4,
            max_num_batched_tokens=16,
            num_kv_blocks=num_kv_blocks,
            dense_decode_bytes=0,  # the paged kernels, as on CUDA
            async_scheduling=async_scheduling,
        )
    )


def test_max_model_len_caps_the_overlapped_loop_too(tiny_model_dir):
    """Requests that end at max_model_len give the synchronous loop's tokens (that no
    step is scheduled past the limit: tests/unit/test_async_scheduler.py)."""
    prompts = _prompts([19, 21, 12])
    requests = [_req(f"r{i}", p, max_tokens=30, temperature=0.0 if i else 0.9, seed=1,
                     ignore_eos=True) for i, p in enumerate(prompts)]  # fmt: skip
    results, _ = same_outputs(tiny_model_dir, requests, max_model_len=24)
    assert [len(results[(f"r{i}", 0)].tokens) for i in range(3)] == [5, 3, 12]


def test_inline_step_stream_as_on_cuda(tiny_model_dir):
    """The overlapped loop with its steps run inline on the loop thread (the CUDA
    arrangement, where launches return before the kernels run): same tokens, with stops,
    aborts, forks, penalties and preemption in one batch."""
    prompts = _prompts([6, 11, 4, 25, 8, 13])
    free, _ = run(tiny_model_dir, [_req("r0", prompts[0], max_tokens=12, temperature=0.0,
                                        ignore_eos=True)], async_scheduling=False)  # fmt: skip
    requests = [
        _req("r0", prompts[0], max_tokens=12, temperature=0.0, ignore_eos=True,
             stop_token_ids=[free[("r0", 0)].tokens[4]]),
        _req("r1", prompts[1], max_tokens=12, temperature=0.9, seed=3, ignore_eos=True, n=2),
        _req("r2", prompts[2], max_tokens=12, temperature=1.0, ignore_eos=True),
        _req("r3", prompts[3], max_tokens=12, temperature=0.0, repetition_penalty=1.3,
             ignore_eos=True),
        _req("r4", prompts[4], max_tokens=12, temperature=0.7, logprobs=2, ignore_eos=True),
        _req("r5", prompts[5], max_tokens=12, temperature=0.0, ignore_eos=True),
    ]  # fmt: skip
    sync, _ = run(tiny_model_dir, requests, async_scheduling=False, num_kv_blocks=20,
                  abort_at={"r5": 3})  # fmt: skip
    inline, engine = run(tiny_model_dir, requests, async_scheduling=True, num_kv_blocks=20,
                         abort_at={"r5": 3}, inline_stream=True)  # fmt: skip
    assert not engine.runner.stream.threaded
    assert sorted(inline) == sorted(sync)
    for key, r in sync.items():
        got = inline[key]
        assert (got.tokens, got.finish_reason, got.stop_reason) == (
            r.tokens,
            r.finish_reason,
            r.stop_reason,
        ), key
        # The loops preempt at different steps, and a recomputed prefix's KV differs from
        # the decoded one in the last float bits: logprobs agree to rounding, not exactly
        # (the synchronous loop with and without preemption differs as much, ~2e-5).
        assert [lp.token_id for lp in got.logprobs] == [lp.token_id for lp in r.logprobs]
        for a, b in zip(got.logprobs, r.logprobs):
            assert a.top_token_ids == b.top_token_ids
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert a.top_logprobs == pytest.approx(b.top_logprobs, abs=1e-4)
    assert engine.scheduler.num_preemptions > 0
