"""``--compile-model``: the opaque attention op equals the eager layer, the whole forward traces
as one graph (``fullgraph``) with the op and gives the eager greedy tokens, compiling before the
KV cache is sized makes the profiling step run the compiled graphs (which then serve the real
cache), and with inductor on CPU (slow: a C++ compile) the engine's tokens equal eager's and
transformers'."""

from __future__ import annotations

import argparse

import pytest
import torch

from tandem.kernels import AttentionMetadata
from tandem.wire.engine_protocol import SamplingParams
from tandem.workers.checkpoints.loader import load_model
from tandem.workers.compile.attention_op import step_context
from tandem.workers.compile.model import compile_before_sizing, compile_model, use_compile
from tandem.workers.config import EngineConfig, add_engine_arguments, engine_overrides
from tandem.workers.engine.llm import LLM
from tandem.workers.graphs.memory import profile_forward
from tandem.workers.runner.attention import attention
from tandem.workers.runner.kv_cache import allocate_kv_cache
from tests.workers.hf_checkpoints import load_hf_model
from tests.workers.mixed_steps import BLOCK_SIZE, last_step_hidden, new_kv_cache
from tests.workers.test_engine import hf_greedy

NUM_NEW = 6
GREEDY = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(2)
    return [torch.randint(3, 300, (n,), generator=g).tolist() for n in (1, 7, 23, 40)]


def _generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    results = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
    llm.engine.check_integrity()
    return [r.token_ids for r in results]


def test_op_equals_the_eager_layer_and_needs_a_step():
    g = torch.Generator().manual_seed(0)
    num_heads, num_kv_heads, head_dim, block_size = 4, 2, 8, 4
    kv_cache = torch.zeros(8, 2, 2, block_size, num_kv_heads, head_dim)
    meta = AttentionMetadata.build([[3, 1], [5]], [6, 2], [6, 1], block_size)
    q = torch.randn(7, num_heads, head_dim, generator=g)
    k, v = torch.randn(2, 7, num_kv_heads, head_dim, generator=g)
    expected_cache = kv_cache.clone()
    expected = attention(1, q, k, v, expected_cache, meta, 0.3)
    with step_context(kv_cache, meta):
        out = torch.ops.tandem.attention(q, k, v, 1, 0.3)
    assert torch.equal(out, expected) and torch.equal(kv_cache, expected_cache)
    assert kv_cache[:, 1].abs().sum() > 0  # the op wrote this step's K/V
    with pytest.raises(RuntimeError, match="outside step_context"):
        torch.ops.tandem.attention(q, k, v, 1, 0.3)


def test_traced_forward_is_one_graph_with_eager_tokens(make_checkpoint):
    """``aot_eager``: dynamo + functionalisation with the op's fake, eager kernels (no codegen,
    seconds); ``fullgraph`` makes any graph break an error. Qwen3: Llama plus q/k norms."""
    path = make_checkpoint("qwen3", num_hidden_layers=2)
    config = EngineConfig.from_flat(
        model=path, block_size=4, max_num_batched_tokens=16, num_kv_blocks=64
    )
    prompts = _prompts()
    eager = _generate(LLM(config), prompts)
    llm = LLM(config)
    torch._dynamo.reset()
    report = compile_model(llm.engine.model, llm.engine.kv_cache, 4, backend="aot_eager")
    assert report.num_graphs == 2
    assert _generate(llm, prompts) == eager  # chunked prefills, decodes, dense decode rows
    assert eager == [hf_greedy(load_hf_model(path), p, NUM_NEW) for p in prompts]
    # int32 ids and positions (CUDA decode graphs' static buffers) give the int64 result
    model, kv_cache = llm.engine.model, llm.engine.kv_cache
    meta = AttentionMetadata.build([[0, 1]], [5], [5], 4)
    meta.slot_mapping = torch.full_like(meta.slot_mapping, -1)  # write nothing
    ids = torch.tensor(prompts[1][:5])
    with torch.inference_mode():
        wide = model(ids, torch.arange(5), kv_cache, meta)
        narrow = model(ids.int(), torch.arange(5, dtype=torch.int32), kv_cache, meta)
    assert torch.equal(wide, narrow)


class CountingBackend:
    """``aot_eager`` that counts the graphs it compiles and the calls each compiled one serves."""

    def __init__(self) -> None:
        self.num_compiled = 0
        self.num_calls = 0
        self._inner = torch._dynamo.lookup_backend("aot_eager")

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> object:
        self.num_compiled += 1
        compiled = self._inner(gm, example_inputs)

        def run(*args):
            self.num_calls += 1
            return compiled(*args)

        return run


def test_compiled_before_sizing_the_profiling_step_runs_the_compiled_graphs(make_checkpoint):
    """The engine's start-up order (workers/engine/startup.py): ``compile_before_sizing`` warms up
    over a one-block dummy cache, then the profiling step (``profile_forward``, a full
    ``max_num_batched_tokens`` step) runs the compiled graphs without compiling again; the same
    graphs then serve a real, larger cache with the eager model's hidden states."""
    path = make_checkpoint("llama", num_hidden_layers=2)
    config = EngineConfig.from_flat(
        model=path, block_size=4, max_num_batched_tokens=48, compile_model="on"
    )
    eager, _ = load_model(path, "float32", "cpu")
    model, _ = load_model(path, "float32", "cpu")
    assert compile_before_sizing(config.replace(compile_model="auto"), model) is None
    torch._dynamo.reset()
    backend = CountingBackend()
    report = compile_before_sizing(config, model, backend=backend)
    assert report is not None and report.num_graphs == 2 and backend.num_compiled == 2
    calls = backend.num_calls
    dummy = allocate_kv_cache(
        1, model.num_layers, 4, model.num_kv_heads, model.head_dim, torch.float32, "cpu"
    )
    profile_forward(
        model, dummy, 4, config.scheduler.max_num_batched_tokens, 16, config.scheduler.max_num_seqs
    )
    assert backend.num_calls == calls + 1  # the profiled forward is the compiled one
    assert backend.num_compiled == 2  # and the warm-up had already compiled it
    assert torch.count_nonzero(dummy) == 0
    with torch.inference_mode():  # inputs made in it, as the runner's step makes them
        compiled, _ = last_step_hidden(model, new_kv_cache(model))
    expected, _ = last_step_hidden(eager, new_kv_cache(eager))
    assert backend.num_compiled == 2 and BLOCK_SIZE != 4  # another cache, another block size
    torch.testing.assert_close(compiled, expected, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_inductor_engine_tokens_equal_eager(tiny_model_dir, async_scheduling):
    """The engine with ``compile_model="on"``: inductor generates C++ on CPU (gcc); with the
    overlapped loop the forward runs on the step stream's thread."""
    config = EngineConfig.from_flat(model=tiny_model_dir, block_size=16, num_kv_blocks=64)
    prompts = _prompts()
    eager = _generate(LLM(config), prompts)
    torch._dynamo.reset()
    llm = LLM(config.replace(compile_model="on", async_scheduling=async_scheduling))
    assert (llm.engine.overlap is not None) == async_scheduling
    assert llm.engine.compile_report is not None and llm.engine.compile_report.seconds > 0
    assert _generate(llm, prompts) == eager


def test_modes_flag_and_field_errors():
    assert not use_compile("auto", "cpu") and not use_compile("auto", "cuda")
    assert use_compile("on", "cpu") and not use_compile("off", "cuda")
    assert not use_compile("auto", "cpu", tensor_parallel_size=2)
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    args = parser.parse_args(["--compile-model", "on"])
    assert engine_overrides(args) == {"compile_model": "on"}
    with pytest.raises(ValueError, match="compile_model must be one of auto, on, off"):
        EngineConfig.from_flat(compile_model="yes")
    with pytest.raises(ValueError, match="compile_model 'on' needs tensor_parallel_size 1"):
        EngineConfig.from_flat(compile_model="on", tensor_parallel_size=2)
