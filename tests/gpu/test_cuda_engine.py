"""The engine on a CUDA device: fp32 greedy tokens equal transformers' on the same GPU
(chunked prefill, shared prefixes), decode CUDA-graph replay gives the eager tokens in fp32
and bf16, and a step, replayed or eager (prefill + decodes), synchronises with the device
exactly once (the sampled tokens; greedy and seeded top-p/top-k). Skipped without CUDA
(tests/conftest.py)."""

from __future__ import annotations

import traceback
import warnings

import pytest
import torch

from tandem.wire.engine_protocol import EngineRequest, SamplingParams
from tandem.workers.config import EngineConfig
from tandem.workers.engine.llm import LLM
from tests.workers.hf_checkpoints import load_hf_model
from tests.workers.test_engine import hf_greedy, prompts_for

pytestmark = pytest.mark.gpu

NUM_NEW = 12
GREEDY = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)


def _config(path: str, **changes) -> EngineConfig:
    base = dict(
        model=path,
        device="cuda",
        dtype="float32",
        block_size=16,
        max_num_batched_tokens=64,
        max_num_seqs=16,
        num_kv_blocks=128,
    )
    base.update(changes)
    return EngineConfig.from_flat(**base)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_fp32_greedy_equals_transformers_on_the_gpu(make_checkpoint, arch):
    path = make_checkpoint(arch)
    prompts = prompts_for(16, 64)
    prompts.append(prompts[2][:40] + [7, 8, 9])  # shares a prefix: a prefix-cache hit
    llm = LLM(_config(path))
    assert llm.engine.runner.graphs is not None  # decode steps replay graphs
    results = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
    hf = load_hf_model(path).cuda()
    for prompt, r in zip(prompts, results):
        assert r.token_ids == hf_greedy(hf, prompt, NUM_NEW), f"prompt of {len(prompt)} tokens"
    assert sum(llm.engine.runner.graphs.num_replays.values()) > 0
    llm.engine.check_integrity()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graph_replay_equals_eager(make_checkpoint, dtype):
    """fp32: ragged prompts, so decode batches are padded to their bucket (6 -> 8, a tail of
    1); the padding rows must not change the real rows' tokens. bf16: eight 8-token prompts,
    one prefill step, then batches of exactly 8 (a padded batch runs other cuBLAS shapes than
    the eager one, whose bf16 rounding may flip a near-tie: not what this test is about)."""
    path = make_checkpoint("llama")
    g = torch.Generator().manual_seed(5)
    lengths = (3, 17, 30, 5, 64, 9) if dtype == "float32" else (8,) * 8
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in lengths]
    eager_llm = LLM(_config(path, dtype=dtype, enforce_eager=True))
    assert eager_llm.engine.runner.graphs is None
    eager = eager_llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
    graph_llm = LLM(_config(path, dtype=dtype, cuda_graph_sizes=[1, 2, 4, 8]))
    graphs = graph_llm.engine.runner.graphs
    replayed = graph_llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
    assert [r.token_ids for r in replayed] == [r.token_ids for r in eager]
    if dtype == "float32":
        assert graphs.num_replays[8] > 0 and graphs.num_replays[1] > 0
    else:
        assert graphs.num_replays == {1: 0, 2: 0, 4: 0, 8: NUM_NEW - 1}
    graph_llm.engine.check_integrity()


SEEDED = SamplingParams(
    max_tokens=NUM_NEW, temperature=0.8, top_p=0.9, top_k=50, seed=7, ignore_eos=True
)


def _syncs_of_one_step(engine) -> list[str]:
    """Every host wait on the device during one engine step: the synchronising CUDA calls
    torch's sync debug mode reports (``.tolist()``, ``.item()``, pageable copies, stream and
    device syncs) and CUDA event waits, which it does not see (the sampled tokens are read
    through a pinned copy and an event, workers/runner/async_step.py)."""
    torch.cuda.synchronize()
    event_waits: list[str] = []
    event_synchronize = torch.cuda.Event.synchronize

    def counted(event) -> None:
        caller = traceback.extract_stack(limit=2)[0]
        event_waits.append(f"Event.synchronize at {caller.filename}:{caller.lineno}")
        event_synchronize(event)

    torch.cuda.set_sync_debug_mode("warn")
    torch.cuda.Event.synchronize = counted
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            engine.step()
    finally:
        torch.cuda.Event.synchronize = event_synchronize
        torch.cuda.set_sync_debug_mode("default")
    syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message).lower()]
    return syncs + event_waits


LOOPS = [False, True]  # the synchronous loop, the overlapped one (--async-scheduling)


# The tiny checkpoints' vocabulary (300) is above the sampler's 256 top-p candidates: the
# seeded case reaches the path whose CPU fallback search would sync.
# logprobs are computed in the step and copied with the sampled ids (one event wait)
WITH_LOGPROBS = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, logprobs=5, ignore_eos=True)


@pytest.mark.parametrize("overlap", LOOPS, ids=["sync", "async"])
@pytest.mark.parametrize(
    "params", [GREEDY, SEEDED, WITH_LOGPROBS], ids=["greedy", "seeded-top-p-top-k", "logprobs"]
)
def test_replayed_decode_step_syncs_once(make_checkpoint, params, overlap):
    config = _config(make_checkpoint("llama"), cuda_graph_sizes=[4], async_scheduling=overlap)
    llm = LLM(config)
    engine, graphs = llm.engine, llm.engine.runner.graphs
    for i, n in enumerate((5, 9, 3)):
        assert engine.add_request(EngineRequest(f"r{i}", list(range(3, 3 + n)), params)) is None
    while graphs.num_replays[4] == 0:
        engine.step()
    syncs = _syncs_of_one_step(engine)
    assert graphs.num_replays[4] == 2
    assert len(syncs) == 1, syncs
    while engine.has_work():
        engine.step()
    engine.check_integrity()


@pytest.mark.parametrize("overlap", LOOPS, ids=["sync", "async"])
@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded-top-p-top-k"])
def test_eager_mixed_step_syncs_once(make_checkpoint, params, overlap):
    """A step with a prefill chunk and decodes runs eager (metadata through pinned memory,
    sampled rows picked on the device): one sync as well."""
    config = _config(make_checkpoint("llama"), cuda_graph_sizes=[4], async_scheduling=overlap)
    llm = LLM(config)
    engine = llm.engine
    for i, n in enumerate((5, 9)):
        assert engine.add_request(EngineRequest(f"d{i}", list(range(3, 3 + n)), params)) is None
    engine.step()  # both prefilled: they decode from now on
    assert engine.add_request(EngineRequest("p", list(range(3, 40)), params)) is None
    syncs = _syncs_of_one_step(engine)
    assert engine.last_step_num_tokens == 2 + 37  # two decodes and the whole prompt, eager
    assert len(syncs) == 1, syncs
    while engine.has_work():
        engine.step()
    engine.check_integrity()
