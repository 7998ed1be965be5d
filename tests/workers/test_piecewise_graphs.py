"""Piecewise CUDA graphs without CUDA: the mode and size flags, the token buffers, and the
piecewise runner replaying through ``EagerBackend`` (the same static buffers and pieces a CUDA
graph replays, attention eager between them): tokens equal the eager path's for mixed steps,
chunked prefills, padded buckets and decode batches, steps above the largest bucket fall back
to eager, padding rows write nothing to the KV cache, and ``full_and_piecewise`` sends decode
batches to the full graphs and the rest to the pieces. The capture itself needs a GPU
(tests/gpu/test_cuda_piecewise.py)."""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter

os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of the Triton kernels

import pytest  # noqa: E402
import torch  # noqa: E402

from tandem.kernels import AttentionMetadata  # noqa: E402
from tandem.wire.engine_protocol import SamplingParams  # noqa: E402
from tandem.workers.config import EngineConfig, add_engine_arguments, engine_overrides  # noqa: E402
from tandem.workers.engine.llm import LLM  # noqa: E402
from tandem.workers.graphs.build import build_step_graphs, make_step_graphs  # noqa: E402
from tandem.workers.graphs.piecewise import PiecewiseGraphRunner  # noqa: E402
from tandem.workers.graphs.runner import EagerBackend  # noqa: E402
from tandem.workers.graphs.sizes import piecewise_sizes  # noqa: E402
from tandem.workers.graphs.token_inputs import StaticTokenInputs  # noqa: E402
from tests.workers import hf_checkpoints  # noqa: E402
from tests.workers.test_decode_graphs import _llm  # noqa: E402  (block 4, budget 16, paged)

# ---- flags and sizes -------------------------------------------------------------------


def test_default_token_sizes_stop_at_512_or_the_step_budget():
    assert piecewise_sizes(2048) == [1, 2, 4, 8, *range(16, 513, 16)]
    assert piecewise_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    assert piecewise_sizes(3) == [1, 2, 3]
    assert piecewise_sizes(64, [32, 8, 8]) == [8, 32]


def test_bad_mode_and_token_sizes_name_the_field():
    for mode in ("full", "FULL", 3):
        with pytest.raises(ValueError, match="cuda_graph_mode"):
            EngineConfig.from_flat(cuda_graph_mode=mode)
    # vLLM's spellings of the modes we have
    assert EngineConfig.from_flat(cuda_graph_mode="FULL_AND_PIECEWISE").graphs.cuda_graph_mode == (
        "full_and_piecewise"
    )
    assert (
        EngineConfig.from_flat(cuda_graph_mode="FULL_DECODE_ONLY").graphs.cuda_graph_mode
        == "decode"
    )
    for sizes in ([0], [17], []):
        with pytest.raises(ValueError, match="piecewise_graph_sizes"):
            EngineConfig.from_flat(max_num_batched_tokens=16, piecewise_graph_sizes=sizes)
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    for argv in (["--cuda-graph-mode", "full"], ["--piecewise-graph-sizes", "8,x"]):
        with pytest.raises(SystemExit):
            parser.parse_args(argv)


def test_flags_reach_the_config_and_pool_overrides():
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    add_engine_arguments(parser, prefix="prefill-")
    args = parser.parse_args(
        ["--cuda-graph-mode", "decode", "--prefill-piecewise-graph-sizes", "8 16"]
    )
    assert engine_overrides(args) == {"cuda_graph_mode": "decode"}
    assert engine_overrides(args, prefix="prefill-") == {"piecewise_graph_sizes": [8, 16]}
    assert (
        EngineConfig.from_flat().graphs.cuda_graph_mode == "full_and_piecewise"
    )  # vLLM's default too; set from the H200 rows in docs/gpu.md


@pytest.mark.parametrize(
    "mode,decode,piecewise",
    [("decode", True, False), ("piecewise", False, True), ("full_and_piecewise", True, True)]
    + [("none", False, False)],
)
def test_mode_picks_the_runners(one_layer_llama, mode, decode, piecewise):
    engine = _llm(one_layer_llama).engine
    config = engine.config.replace(cuda_graph_mode=mode, cuda_graph_sizes=[1, 2])
    graphs = make_step_graphs(config, engine.model, engine.kv_cache, 64, EagerBackend())
    assert (graphs.decode is not None, graphs.piecewise is not None) == (decode, piecewise)
    eager = config.replace(enforce_eager=True)
    graphs = make_step_graphs(eager, engine.model, engine.kv_cache, 64, EagerBackend())
    assert graphs.decode is None and graphs.piecewise is None
    # on CPU the engine captures nothing, whatever the mode
    built = build_step_graphs(config, engine.model, engine.kv_cache, 64)
    assert built.decode is None and built.piecewise is None


# ---- token buffers ---------------------------------------------------------------------


def test_fill_pads_to_the_bucket_and_overwrites_stale_rows():
    inputs = StaticTokenInputs(max_tokens=8, device="cpu")
    inputs.fill([11, 12, 13, 14, 15], [0, 1, 2, 7, 3], torch.tensor([4, 5, 6, 30, 9]), 8)
    ids, positions, slots = inputs.views(8)
    assert ids.tolist() == [11, 12, 13, 14, 15, 0, 0, 0]
    assert positions.tolist() == [0, 1, 2, 7, 3, 0, 0, 0]
    assert slots.tolist() == [4, 5, 6, 30, 9, -1, -1, -1]
    inputs.fill([21, 22], [5, 6], torch.tensor([40, 41]), 4)
    ids, positions, slots = inputs.views(4)
    assert ids.tolist() == [21, 22, 0, 0]
    assert positions.tolist() == [5, 6, 0, 0]
    assert slots.tolist() == [40, 41, -1, -1]  # the old rows 2, 3 are padding now
    inputs.fill([], [], None, 8)
    assert inputs.views(8)[2].tolist() == [-1] * 8
    with pytest.raises(ValueError, match="size"):
        inputs.fill([1, 2, 3], [0, 1, 2], torch.tensor([1, 2, 3]), 2)
    with pytest.raises(ValueError, match="slot_mapping"):
        inputs.fill([1], [0], None, 2)


# ---- the runner against the eager path -----------------------------------------------

# Prompts of 5, 9, 2, 23 (chunked: the step budget is 16) and 3 tokens.
PROMPTS = [[5, 9, 2, 7, 1], [3] * 9, [8, 4], [(7 * i) % 50 + 3 for i in range(23)], [6, 6, 1]]
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


class _StepLog:
    """Wraps ``PiecewiseGraphRunner.run``: each step's token count and replayed bucket."""

    def __init__(self, runner: PiecewiseGraphRunner) -> None:
        self.steps: list[tuple[int, int | None]] = []
        run = runner.run

        def logged(input_ids, *args):
            hidden = run(input_ids, *args)
            self.steps.append(
                (len(input_ids), None if hidden is None else runner.bucket_for(len(input_ids)))
            )
            return hidden

        runner.run = logged


def _with_graphs(llm: LLM, mode: str, token_sizes: list[int], decode_sizes=(1, 2)):
    engine = llm.engine
    config = engine.config.replace(
        cuda_graph_mode=mode,
        cuda_graph_sizes=list(decode_sizes),
        piecewise_graph_sizes=token_sizes,
    )
    graphs = make_step_graphs(
        config, engine.model, engine.kv_cache, engine.max_model_len, EagerBackend()
    ).capture()
    engine.runner.graphs, engine.runner.piecewise = graphs.decode, graphs.piecewise
    return graphs


@pytest.fixture(scope="module")
def one_layer_llama(tmp_path_factory) -> str:
    return hf_checkpoints.make_checkpoint(
        "llama", tmp_path_factory.mktemp("ckpt-pw1"), num_hidden_layers=1
    )


@pytest.fixture(scope="module")
def two_layer_llama(tmp_path_factory) -> str:
    return hf_checkpoints.make_checkpoint(
        "llama", tmp_path_factory.mktemp("ckpt-pw2"), num_hidden_layers=2
    )


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def two_layer_checkpoint(request, tmp_path_factory) -> str:
    # two layers: a middle piece (layer 0 after attention + layer 1 before it) is exercised
    return hf_checkpoints.make_checkpoint(
        request.param, tmp_path_factory.mktemp(f"ckpt-pw-{request.param}"), num_hidden_layers=2
    )


@pytest.fixture(scope="module")
def eager_tokens(two_layer_checkpoint) -> list[list[int]]:
    results = _llm(two_layer_checkpoint).generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)
    return [r.token_ids for r in results]


def test_piecewise_gives_the_eager_tokens_for_every_kind_of_step(
    two_layer_checkpoint, eager_tokens
):
    llm = _llm(two_layer_checkpoint)
    graphs = _with_graphs(llm, "piecewise", [4, 8, 16])
    log = _StepLog(graphs.piecewise)
    results = llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)
    assert [r.token_ids for r in results] == eager_tokens
    # every step fits a bucket (budget 16): each replayed the smallest bucket that holds it
    assert log.steps and all(b == min(s for s in (4, 8, 16) if s >= n) for n, b in log.steps)
    token_counts = {n for n, _ in log.steps}
    assert 16 in token_counts  # full prefill / chunk steps
    assert any(n not in (4, 8, 16) for n in token_counts)  # padded steps
    assert sum(graphs.piecewise.num_replays.values()) == len(log.steps)
    llm.engine.check_integrity()


def test_steps_above_the_largest_bucket_run_eager(two_layer_checkpoint, eager_tokens):
    llm = _llm(two_layer_checkpoint)
    graphs = _with_graphs(llm, "piecewise", [2, 8])
    log = _StepLog(graphs.piecewise)
    results = llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)
    assert [r.token_ids for r in results] == eager_tokens
    assert any(b is None for _, b in log.steps) and any(b is not None for _, b in log.steps)
    for n, bucket in log.steps:
        assert bucket == (None if n > 8 else (2 if n <= 2 else 8)), (n, bucket)
    llm.engine.check_integrity()


def test_full_and_piecewise_sends_decode_batches_to_the_full_graphs(two_layer_llama, monkeypatch):
    eager_tokens = [
        r.token_ids
        for r in _llm(two_layer_llama).generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)
    ]
    # the full decode graphs' metadata is exact only for the kernels' tensors (Triton, as on
    # CUDA); the torch reference reads its host lists, which describe a padding batch
    monkeypatch.setenv("TANDEM_FORCE_TRITON", "1")
    llm = _llm(two_layer_llama)
    graphs = _with_graphs(llm, "full_and_piecewise", [4, 8, 16], decode_sizes=(1, 2, 4))
    log = _StepLog(graphs.piecewise)
    results = llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)
    assert [r.token_ids for r in results] == eager_tokens
    assert sum(graphs.decode.num_replays.values()) > 0
    assert sum(graphs.piecewise.num_replays.values()) > 0
    # a step only reaches the pieces when the full graphs declined it: it has a prefill
    # token (more tokens than sequences) or more decodes than the largest decode bucket
    assert all(n > 1 for n, _ in log.steps)
    llm.engine.check_integrity()


def test_a_padded_step_writes_only_its_own_slots_and_matches_eager(two_layer_checkpoint):
    llm = _llm(two_layer_checkpoint)
    engine = llm.engine
    graphs = _with_graphs(llm, "piecewise", [16])
    model, cache = engine.model, engine.kv_cache
    cache.normal_(generator=torch.Generator().manual_seed(3))  # prior context, nonzero
    # a mixed step: a decode at position 9 (context 10) and a 3-token chunk at 4..6
    tables, seq_lens, query_lens = [[3, 7, 11], [5, 2]], [10, 7], [1, 3]
    ids, positions = [17, 4, 8, 15], [9, 4, 5, 6]
    meta = AttentionMetadata.build(tables, seq_lens, query_lens, 4)
    eager_cache, before = cache.clone(), cache.clone()
    with torch.inference_mode():
        expected = model(torch.tensor(ids), torch.tensor(positions), eager_cache, meta)
        hidden = graphs.piecewise.run(ids, positions, tables, seq_lens, query_lens)
    assert hidden.shape == expected.shape
    torch.testing.assert_close(hidden, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cache, eager_cache, rtol=1e-5, atol=1e-5)

    def by_slot(kv: torch.Tensor) -> torch.Tensor:  # [slot, everything else]
        return kv.permute(0, 3, 1, 2, 4, 5).reshape(kv.shape[0] * kv.shape[3], -1)

    written = meta.slot_mapping.tolist()
    untouched = [s for s in range(cache.shape[0] * 4) if s not in written]
    assert torch.equal(by_slot(cache)[untouched], by_slot(before)[untouched])  # padding: none
    assert not torch.equal(by_slot(cache)[written], by_slot(before)[written])
    assert graphs.piecewise.num_replays == {16: 1}


def test_the_triton_path_gives_the_eager_tokens(one_layer_llama, monkeypatch):
    monkeypatch.setenv("TANDEM_FORCE_TRITON", "1")  # every kernel in Triton, interpreted
    prompts = PROMPTS[:3]
    eager = _llm(one_layer_llama).generate(prompt_token_ids=prompts, sampling_params=GREEDY)
    llm = _llm(one_layer_llama)
    graphs = _with_graphs(llm, "piecewise", [8, 16])
    results = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
    assert [r.token_ids for r in results] == [r.token_ids for r in eager]
    assert graphs.piecewise.num_replays[16] >= 1 and graphs.piecewise.num_replays[8] >= 1
    llm.engine.check_integrity()


def test_sdpa_prefills_attend_over_the_pieces_k_and_v(two_layer_llama):
    # --prefill-attention sdpa: fresh prompts attend over the step's own K/V, which the
    # pieces hand to attention through the static qkv buffer
    from tandem.kernels.prefill_attention import NUM_CALLS

    def llm_sdpa() -> LLM:
        return LLM(_llm(two_layer_llama).engine.config.replace(prefill_attention="sdpa"))

    eager = llm_sdpa().generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)
    llm = llm_sdpa()
    graphs = _with_graphs(llm, "piecewise", [8, 16])
    assert graphs.piecewise.sdpa_prefills
    before = NUM_CALLS["sdpa_groups"]
    results = llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)
    assert NUM_CALLS["sdpa_groups"] > before
    assert [r.token_ids for r in results] == [r.token_ids for r in eager]
    assert sum(graphs.piecewise.num_replays.values()) > 0
    llm.engine.check_integrity()


def test_a_piecewise_mixed_step_reads_the_device_once(one_layer_llama, monkeypatch):
    from tandem.wire.engine_protocol import EngineRequest
    from tests.workers.test_decode_graphs import _CountHostReads

    monkeypatch.setenv("TANDEM_FORCE_TRITON", "1")  # the kernels CUDA runs, interpreted
    llm = _llm(one_layer_llama)
    graphs = _with_graphs(llm, "piecewise", [16])
    engine = llm.engine
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS[:2]):
        assert engine.add_request(EngineRequest(f"r{i}", prompt, params)) is None
    engine.step()  # both prompts (14 tokens)
    assert engine.add_request(EngineRequest("r2", PROMPTS[3], params)) is None
    with _CountHostReads() as counter:
        engine.step()  # two decodes + a 14-token chunk of r2: a mixed step of 16 tokens
    assert graphs.piecewise.num_replays[16] == 2
    # the one read: the step's sampled tokens (workers/runner/async_step.py, StepResult.token_list)
    assert len(counter.reads) == 1 and "async_step.py" in counter.reads[0], counter.reads
    while engine.has_work():
        engine.step()
    engine.check_integrity()


def _in_triton(frame) -> bool:
    """Called from the Triton interpreter (its own torch calls launch nothing on a GPU)."""
    while frame is not None:
        if f"{os.sep}triton{os.sep}" in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False


def _launches_outside_pieces(path: str) -> Counter:
    """Kernel launches a mixed step enqueues outside the captured pieces (what a graph replay
    does not cover): aten ops that launch a kernel plus Triton launches."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from triton.runtime import interpreter

    from tandem.wire.engine_protocol import EngineRequest
    from tests.workers.test_triton_path import _NO_LAUNCH

    llm = _llm(path)
    runner = _with_graphs(llm, "piecewise", [16]).piecewise
    counting, counts = [False], Counter()

    def uncounted(piece):
        def run():
            counting[0] = False
            piece()
            counting[0] = True

        return run

    runner.replays = {size: list(map(uncounted, p)) for size, p in runner.replays.items()}

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.__name__.split(".")[0]
            if counting[0] and name not in _NO_LAUNCH and not _in_triton(sys._getframe(1)):
                counts[name] += 1
            return func(*args, **(kwargs or {}))

    launch = interpreter.InterpretedFunction.__getitem__

    def counted_launch(kernel, grid):
        if counting[0]:
            counts["triton:" + kernel.fn.__name__] += 1
        return launch(kernel, grid)

    engine = llm.engine
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS[:2]):
        assert engine.add_request(EngineRequest(f"r{i}", prompt, params)) is None
    engine.step()
    assert engine.add_request(EngineRequest("r2", PROMPTS[3], params)) is None
    interpreter.InterpretedFunction.__getitem__ = counted_launch
    try:
        with Count():
            counting[0] = True
            engine.step()  # 2 decodes + a 14-token chunk
            counting[0] = False
    finally:
        interpreter.InterpretedFunction.__getitem__ = launch
    assert engine.last_step_num_tokens == 16 and runner.num_replays[16] == 2
    engine.abort(["r0", "r1", "r2"])
    while engine.has_work():
        engine.step()
    engine.check_integrity()
    return counts


def test_outside_the_pieces_a_layer_is_attention_and_one_copy(
    one_layer_llama, two_layer_llama, monkeypatch
):
    """Eager, a layer is nine launches (tests/workers/test_triton_path.py); replayed in
    pieces, the host enqueues only its attention and the copy of attention's output."""
    monkeypatch.setenv("TANDEM_FORCE_TRITON", "1")
    per_layer = _launches_outside_pieces(two_layer_llama) - _launches_outside_pieces(
        one_layer_llama
    )
    assert per_layer == Counter({"triton:_paged_attention_kernel": 1, "copy_": 1}), per_layer
