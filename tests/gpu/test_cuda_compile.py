"""``--compile-model on`` on a CUDA device: inductor's Triton kernels for the norms, matmuls
and MLP, rope traced, the opaque op for KV write + paged attention, decode CUDA graphs over
the compiled forward; fp32 greedy tokens equal eager's and transformers', bf16 hidden states
close to eager's; an engine sized by ``gpu_memory_utilization`` profiles the compiled forward
(compiled before sizing: no graph compiled after start-up) and stays inside its share. Skipped
without CUDA (tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from tandem.wire.engine_protocol import SamplingParams
from tandem.workers.checkpoints.loader import load_model
from tandem.workers.compile.model import compile_model
from tandem.workers.engine.llm import LLM
from tests.gpu.memory_share import (
    assert_inside_share,
    device_before,
    full_budget_prompts,
    share_checkpoint,
)
from tests.gpu.test_cuda_engine import _config
from tests.workers.hf_checkpoints import load_hf_model
from tests.workers.mixed_steps import BLOCK_SIZE, last_step_hidden, new_kv_cache
from tests.workers.test_engine import hf_greedy, prompts_for

pytestmark = pytest.mark.gpu

NUM_NEW = 12
GREEDY = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)


def _compile_config(path: str, **changes):
    return _config(path, **{"cuda_graph_sizes": [1, 2, 4, 8], **changes})


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_compiled_fp32_equals_eager_and_transformers(make_checkpoint, arch):
    path = make_checkpoint(arch)
    prompts = prompts_for(16, 64)
    prompts.append(prompts[2][:40] + [7, 8, 9])  # a prefix-cache hit
    eager = LLM(_compile_config(path)).generate(prompt_token_ids=prompts, sampling_params=GREEDY)
    torch._dynamo.reset()
    llm = LLM(_compile_config(path, compile_model="on"))
    assert llm.engine.compile_report is not None
    graphs = llm.engine.runner.graphs
    compiled = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
    assert [r.token_ids for r in compiled] == [r.token_ids for r in eager]
    assert sum(graphs.num_replays.values()) > 0  # decode graphs replayed the compiled forward
    hf = load_hf_model(path).cuda()
    for prompt, r in zip(prompts, compiled):
        assert r.token_ids == hf_greedy(hf, prompt, NUM_NEW), f"prompt of {len(prompt)} tokens"
    llm.engine.check_integrity()


def test_compiled_bf16_hidden_states_close_to_eager(make_checkpoint):
    """bf16 tokens may flip at near-ties between inductor's fused norms and the Triton ones,
    so compare the hidden states of a prefill step and a mixed step."""
    path = make_checkpoint("llama", num_hidden_layers=2)
    hidden = []
    for compiled in (False, True):
        model, _ = load_model(path, "bfloat16", "cuda")
        kv_cache = new_kv_cache(model, "cuda")
        if compiled:
            torch._dynamo.reset()
            compile_model(model, kv_cache, BLOCK_SIZE)
        hidden.append(last_step_hidden(model, kv_cache)[0])
    eager, compiled = hidden
    assert (compiled - eager).abs().max() <= 2e-2 * eager.abs().max()


def test_compiled_engine_profiles_the_compiled_forward_and_stays_inside_its_share(
    make_checkpoint,
):
    """``profile_step_memory`` runs after ``compile_before_sizing``: the profiling step and
    capture run the warm compiled graphs (inductor's buffers in the activation peak), so what
    the engine holds after generating full-budget steps stays within its share, and no graph
    is compiled after the warm-up (profiling, capture and serving reuse its graphs)."""
    path = share_checkpoint(make_checkpoint)
    torch._dynamo.reset()
    counters.clear()
    before = device_before()
    share = 0.1
    llm = LLM(
        _compile_config(
            path,
            num_kv_blocks=None,
            gpu_memory_utilization=share,
            max_num_batched_tokens=512,
            max_num_seqs=32,
            cuda_graph_sizes=None,
            compile_model="on",
        )
    )
    engine = llm.engine
    report, profiled = engine.compile_report, engine.step_memory
    assert report is not None and profiled.activation_bytes > 0 and profiled.graph_bytes > 0
    llm.generate(prompt_token_ids=full_budget_prompts(), sampling_params=GREEDY)
    assert sum(engine.runner.graphs.num_replays.values()) > 0
    assert counters["stats"]["unique_graphs"] == report.num_graphs  # warm-up's graphs only
    assert_inside_share(engine, before, share)
    engine.check_integrity()
