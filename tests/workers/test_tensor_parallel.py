"""Tensor parallelism (workers/parallel/): the split, the sharded loading, and
whole engines of N gloo ranks whose greedy fp32 output equals TP=1 and
transformers, token for token; a worker dying fails the engine cleanly."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from tandem.wire.engine_protocol import EngineRequest, SamplingParams
from tandem.workers.checkpoints.loader import iter_safetensors, safetensors_files
from tandem.workers.config import EngineConfig
from tandem.workers.engine.llm import LLM
from tandem.workers.parallel.loading import ZEROS_OFF_RANK0, iter_rank_weights, shard_for
from tandem.workers.parallel.messages import WorkerFailed
from tandem.workers.parallel.plan import make_plan
from tandem.workers.parallel.worker import FAULT_EXIT_AT_STEP, FAULT_RAISE_AT_STEP
from tests.workers.hf_checkpoints import load_hf_model, make_config
from tests.workers.test_engine import hf_greedy

NUM_NEW = 6
GREEDY = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    # one token, one block, several blocks, and more than the step's token budget
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (1, 8, 27, 70)]


def _config(path: str, tp: int, **kw) -> EngineConfig:
    return EngineConfig.from_flat(
        model=path,
        block_size=8,
        num_kv_blocks=48,
        max_num_batched_tokens=48,
        tensor_parallel_size=tp,
        torch_threads=1,
        **kw,
    )


# ---- the split (no processes) ---------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "tp", "field"),
    [
        ({"num_attention_heads": 4, "num_key_value_heads": 2}, 3, "num_attention_heads"),
        (
            {"num_attention_heads": 12, "num_key_value_heads": 4, "hidden_size": 96},
            6,
            "num_key_value_heads",
        ),
        ({"intermediate_size": 130}, 4, "intermediate_size"),
    ],
)
def test_split_that_does_not_divide_names_the_field(overrides, tp, field):
    with pytest.raises(ValueError, match=field):
        make_plan(make_config("llama", **overrides), tp, 0)


def test_tensor_parallel_size_must_be_positive():
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig.from_flat(tensor_parallel_size=0)


def test_kv_heads_split_or_replicated():
    split = [make_plan(make_config("llama", num_key_value_heads=4), 2, r) for r in range(2)]
    assert [(p.kv_head_start, p.num_kv_heads_per_rank) for p in split] == [(0, 2), (2, 2)]
    # 2 KV heads on 4 ranks: each rank holds one whole head, two ranks per head
    rep = [make_plan(make_config("llama"), 4, r) for r in range(4)]
    assert [(p.kv_head_start, p.num_kv_heads_per_rank) for p in rep] == [(0, 1)] * 2 + [(1, 1)] * 2
    assert rep[0].kv_replication == 2
    # a rank's query heads all use its KV head (GQA group of q head h: h // (H / Hkv))
    for p in rep:
        group = p.num_heads // p.num_kv_heads
        q_heads = range(p.rank * p.num_heads_per_rank, (p.rank + 1) * p.num_heads_per_rank)
        assert {h // group for h in q_heads} == {p.kv_head_start}


def test_rank_slices_rebuild_every_weight(make_checkpoint):
    """The ranks' slices, joined along their split dim, are the checkpoint
    (vocab padding dropped; a row-parallel bias only on rank 0)."""
    path = make_checkpoint("qwen3_bias", vocab_size=301)
    files = safetensors_files(path)
    config = make_config("qwen3_bias", vocab_size=301)
    plans = [make_plan(config, 2, r) for r in range(2)]
    per_rank = [dict(iter_rank_weights(files, p)) for p in plans]
    full = dict(iter_safetensors(files))
    assert set(per_rank[0]) == set(full)
    for name, tensor in full.items():
        rule = shard_for(name, plans[0])
        parts = [w[name] for w in per_rank]
        if rule is None:
            assert all(torch.equal(p, tensor) for p in parts), name
        elif rule == ZEROS_OFF_RANK0:
            assert torch.equal(parts[0], tensor) and not parts[1].any(), name
        else:
            joined = torch.cat(parts, dim=rule.dim).narrow(rule.dim, 0, tensor.shape[rule.dim])
            assert torch.equal(joined, tensor), name
    assert per_rank[1]["model.embed_tokens.weight"].shape[0] == 151  # 150 rows + 1 pad


def test_flags():
    from tandem.cluster.cli.main import build_parser

    args = build_parser().parse_args(["generate", "--model", "tiny", "-tp", "2", "--prompt", "x"])
    assert args.tensor_parallel_size == 2
    serve = build_parser().parse_args(
        ["serve", "--prefill-tensor-parallel-size", "2", "--decode-tensor-parallel-size", "1"]
    )
    assert (serve.prefill_tensor_parallel_size, serve.decode_tensor_parallel_size) == (2, 1)


# ---- whole engines (N processes, gloo) -------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    ("arch", "tp", "overrides"),
    [
        # tied embeddings (vocab-parallel lm_head = embedding rows), q/k/v biases, padded vocab
        ("qwen2_tied", 2, {"vocab_size": 301}),
        # 4 KV heads on 4 ranks: one each
        ("llama", 4, {"num_attention_heads": 4, "num_key_value_heads": 4}),
        # 1 KV head on 2 ranks: replicated; q/k norms and an o_proj bias (row-parallel, once)
        ("qwen3_bias", 2, {"num_key_value_heads": 1}),
    ],
)
def test_greedy_equals_tp1_and_transformers(make_checkpoint, arch, tp, overrides):
    path = make_checkpoint(arch, **overrides)
    prompts = _prompts(overrides.get("vocab_size", 300))
    ref = LLM(_config(path, 1)).generate(prompt_token_ids=prompts, sampling_params=GREEDY)
    kv_heads = overrides.get("num_key_value_heads", 2)
    with LLM(_config(path, tp)) as llm:
        # rank 0's KV shard: [blocks, layers, 2, block_size, its KV heads, head_dim]
        assert llm.engine.kv_cache.shape[4] == max(1, kv_heads // tp)
        got = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
        llm.engine.check_integrity()
    hf = load_hf_model(path)
    for prompt, a, b in zip(prompts, ref, got):
        assert b.error is None and b.finish_reason == "length"
        assert b.token_ids == a.token_ids == hf_greedy(hf, prompt, NUM_NEW), len(prompt)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("fault", "message"),
    [
        (FAULT_EXIT_AT_STEP, "exited with code 17"),
        (FAULT_RAISE_AT_STEP, "RuntimeError: injected fault at step 3"),
    ],
)
def test_worker_failing_mid_step_fails_every_request(make_checkpoint, fault, message):
    """Rank 1 exits (or raises) as step 3's command arrives: rank 0 is then
    inside its forward, in a collective rank 1 never joins."""
    path = make_checkpoint("llama")
    cfg = _config(path, 2, extra={fault: 3})
    with LLM(cfg) as llm:
        results = llm.generate(prompt_token_ids=_prompts(300), sampling_params=GREEDY)
        for r in results:
            assert r.finish_reason == "error"
            assert "rank 1" in r.error and message in r.error, r.error
        llm.engine.check_integrity()
        # the engine stays failed: a later request ends in the same error, at once
        (again,) = llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=GREEDY)
        assert again.finish_reason == "error" and "rank 1" in again.error
        assert all(p.exitcode is not None for p in llm.engine.tp.procs)


@pytest.mark.slow
def test_killed_worker_between_steps_fails_the_step(make_checkpoint):
    path = make_checkpoint("llama")
    with LLM(_config(path, 2)) as llm:
        engine = llm.engine
        engine.add_request(EngineRequest("a", list(range(3, 40)), GREEDY))
        engine.step()
        (worker,) = engine.tp.procs
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(30)
        with pytest.raises(
            WorkerFailed, match=f"rank 1 \\(pid {worker.pid}\\) exited with code -9"
        ):
            while engine.has_work():
                engine.step()
        engine.abort(["a"])
        engine.check_integrity()


def _resume(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:  # already killed by the engine
        pass


@pytest.mark.slow
def test_stopped_worker_fails_the_engine_within_the_step_timeout(make_checkpoint):
    """SIGSTOP on rank 1: a stopped process neither exits nor closes its
    sockets, so only the deadline can tell. Rank 0 must name the rank within
    ``tp_step_timeout_s`` (and kill it), in a step and while idle."""
    step_timeout_s = 6.0
    path = make_checkpoint("llama")
    cfg = _config(path, 2, tp_step_timeout_s=step_timeout_s)
    # in a step: the stop lands between two steps of running requests
    with LLM(cfg) as llm:
        engine = llm.engine
        engine.add_request(EngineRequest("a", list(range(3, 40)), GREEDY))
        engine.step()
        (worker,) = engine.tp.procs
        os.kill(worker.pid, signal.SIGSTOP)
        start_s = time.monotonic()
        try:
            with pytest.raises(WorkerFailed, match=f"rank 1 \\(pid {worker.pid}\\) unresponsive"):
                while engine.has_work():
                    engine.step()
            elapsed_s = time.monotonic() - start_s
        finally:
            _resume(worker.pid)
        # the collective gives up after the deadline; the heartbeat is then
        # already stale, the rank killed at once (a margin for a loaded box)
        assert step_timeout_s <= elapsed_s < step_timeout_s + 15, elapsed_s
        assert worker.exitcode == -signal.SIGKILL
        (again,) = llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=GREEDY)
        assert again.finish_reason == "error" and "unresponsive" in again.error
        engine.abort(["a"])
        engine.check_integrity()
    # while idle: the engine loop's idle call notices the silent heartbeat
    with LLM(cfg) as llm:
        (worker,) = llm.engine.tp.procs
        os.kill(worker.pid, signal.SIGSTOP)
        start_s = time.monotonic()
        try:
            with pytest.raises(WorkerFailed, match="rank 1 .* unresponsive"):
                while time.monotonic() - start_s < 3 * step_timeout_s:
                    llm.engine.runner.release_idle_memory()
                    time.sleep(0.05)
            elapsed_s = time.monotonic() - start_s
        finally:
            _resume(worker.pid)
        # stale at T/2 after its last beat, sent up to one interval (T/10) before the stop
        assert 0.4 * step_timeout_s <= elapsed_s < step_timeout_s + 15, elapsed_s
        assert worker.exitcode == -signal.SIGKILL
        results = llm.generate(prompt_token_ids=_prompts(300), sampling_params=GREEDY)
        assert all(r.finish_reason == "error" and "unresponsive" in r.error for r in results)
        llm.engine.check_integrity()


def test_tp_step_timeout_must_be_positive():
    with pytest.raises(ValueError, match="tp_step_timeout_s"):
        EngineConfig.from_flat(tp_step_timeout_s=0)


def test_pool_gpus_must_cover_the_tensor_parallel_size():
    from tandem.cluster.engines.placement import check_pool_parallel

    with pytest.raises(ValueError, match="decode_num_gpus_per_engine"):
        check_pool_parallel("decode", EngineConfig.from_flat(tensor_parallel_size=2), num_gpus=1)
    check_pool_parallel(
        "colocated", EngineConfig.from_flat(tensor_parallel_size=2), num_gpus=0
    )  # CPU
    check_pool_parallel("prefill", EngineConfig.from_flat(tensor_parallel_size=2), num_gpus=2)


def test_serve_refuses_a_pool_size_that_does_not_split_the_model(tiny_model_dir):
    from tandem.cluster.engines.placement import check_pools_split_model
    from tandem.cluster.engines.pools import PoolSpec

    specs = [
        PoolSpec("prefill", 1, EngineConfig.from_flat(tensor_parallel_size=2)),
        PoolSpec("decode", 1, EngineConfig.from_flat(tensor_parallel_size=3)),
    ]
    with pytest.raises(ValueError, match="decode pool: .*num_attention_heads"):
        check_pools_split_model(tiny_model_dir, specs)
    check_pools_split_model(tiny_model_dir, specs[:1])


def test_sharded_weights_are_read_as_slices(make_checkpoint, monkeypatch):
    """A rank never reads a sharded tensor whole: only replicated ones go
    through ``get_tensor``; the rest through ``get_slice`` ranges."""
    import safetensors

    path = make_checkpoint("qwen2")
    plan = make_plan(make_config("qwen2"), 2, 1)
    whole: list[str] = []
    real_open = safetensors.safe_open

    class Recording:
        def __init__(self, *args, **kwargs):
            self.f = real_open(*args, **kwargs)

        def __enter__(self):
            self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def keys(self):
            return self.f.keys()

        def get_tensor(self, name):
            whole.append(name)
            return self.f.get_tensor(name)

        def get_slice(self, name):
            return self.f.get_slice(name)

    monkeypatch.setattr(safetensors, "safe_open", Recording)
    names = [name for name, _ in iter_rank_weights(safetensors_files(path), plan)]
    assert whole and all(shard_for(n, plan) is None for n in whole)
    assert {n for n in names if shard_for(n, plan) is not None}.isdisjoint(whole)
    assert any(n.endswith("q_proj.weight") for n in names)


@pytest.mark.slow
@pytest.mark.parametrize("exit_seen", [True, False])
def test_commands_to_a_killed_worker_never_block(make_checkpoint, monkeypatch, exit_seen):
    """A killed worker's command socket has no peer a moment after the kill
    (its kernel closed the connection), before Ray reports the actor dead
    (``exit_seen`` False: the window a Ray worker's exit code is not known
    yet): what rank 0 sends it (stats, idle release, a step) fails the
    engine instead of blocking the engine loop for good."""
    path = make_checkpoint("llama")
    with LLM(_config(path, 2, tp_step_timeout_s=4.0)) as llm:
        tp = llm.engine.tp
        (worker,) = tp.procs
        os.kill(worker.pid, signal.SIGKILL)
        time.sleep(0.5)  # the pipe is gone
        if not exit_seen:
            monkeypatch.setattr(type(worker), "exitcode", property(lambda self: None))
            monkeypatch.setattr(tp.heartbeats, "stale_after_s", 1e9)
        start_s = time.monotonic()
        with pytest.raises(WorkerFailed):
            tp.sum_kv_stats({})
        assert time.monotonic() - start_s < 4.0 + 2.0
        monkeypatch.undo()


def test_a_reply_read_by_the_liveness_check_still_reaches_its_waiter(make_checkpoint):
    """The liveness check between polls reads every reply looking for a worker's error;
    a reply that lands between ``_await``'s poll and that check must still count (it was
    dropped once, and rank 0 then waited out its whole timeout for a READY it had read)."""
    from tandem.workers.parallel.messages import CMD_KV_STATS, REPLY_KV_STATS

    path = make_checkpoint("llama")
    with LLM(_config(path, 2)) as llm:
        tp = llm.engine.tp
        tp._num_stats += 1
        tp.broadcast(CMD_KV_STATS, tp._num_stats)
        deadline = time.monotonic() + 60
        while not tp._unread:  # the check reads the reply, as it would between two polls
            assert tp._worker_trouble(wait_s=0.05) is None
            assert time.monotonic() < deadline, "rank 1 never answered"
        (reply,) = tp._await(REPLY_KV_STATS, 5.0, step=tp._num_stats)
        assert reply.rank == 1 and not tp._unread
        (out,) = llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=GREEDY)
        assert out.finish_reason == "length"
        llm.engine.check_integrity()
