"""The prefill split on a CUDA device: prefix-free prefills through torch's varlen flash kernel
(fp16/bf16) or batched SDPA (fp32), the rest through the compiled Triton paged kernel, against
the torch reference; the engine with ``prefill_attention="sdpa"`` token-exact with transformers
in fp32, and bf16 ``auto`` (the split) close to bf16 ``triton``. Skipped without CUDA
(tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

from tandem.kernels import AttentionMetadata, prefill_attention, reference
from tandem.wire.engine_protocol import SamplingParams
from tandem.workers.checkpoints.loader import load_model
from tandem.workers.engine.llm import LLM
from tests.gpu.test_cuda_engine import _config
from tests.kernels.cases import make_case, write_oracle
from tests.workers.hf_checkpoints import load_hf_model
from tests.workers.mixed_steps import last_step_hidden, new_kv_cache
from tests.workers.test_engine import hf_greedy, prompts_for

pytestmark = pytest.mark.gpu

# fresh prompts of several lengths (two of 130: one flash call still packs them), a decode,
# a later chunk and a prefix hit
MIXED = [(9, 9), (13, 1), (130, 130), (300, 1), (20, 6), (1, 1), (130, 130), (200, 70), (77, 77)]
# fp32: SDPA's memory-efficient kernel vs the CPU reference (margin for its dot precision)
TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 5e-3}


def _cuda_case(dtype, heads=(8, 2), head_dim=64, block_size=16):
    case = make_case(MIXED, block_size, heads[0], heads[1], head_dim, dtype=dtype)
    write_oracle(case)
    case.query, case.key, case.value = (t.cuda() for t in (case.query, case.key, case.value))
    case.kv_cache = case.kv_cache.cuda()
    meta = case.meta
    for name in ("slot_mapping", "block_tables", "seq_lens", "query_start_loc"):
        setattr(meta, name, getattr(meta, name).cuda())
    meta.sdpa_prefills = True
    return case


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,head_dim", [((8, 2), 64), ((4, 4), 128), ((6, 1), 80)])
def test_split_matches_reference(dtype, heads, head_dim):
    case = _cuda_case(dtype, heads, head_dim)
    before = prefill_attention.NUM_CALLS.copy()
    out = prefill_attention.attend(
        case.query, case.key, case.value, case.layer_cache, case.meta, case.scale
    )
    expected = reference.paged_attention(
        case.query.cpu(), case.layer_cache.cpu(), _cpu_meta(case.meta), case.scale
    )
    torch.testing.assert_close(
        out.cpu().float(), expected.float(), atol=TOL[dtype], rtol=TOL[dtype]
    )
    used = prefill_attention.NUM_CALLS - before
    assert used == {"flash_varlen" if dtype != torch.float32 else "sdpa_groups": 1}, used


def _cpu_meta(meta: AttentionMetadata) -> AttentionMetadata:
    return AttentionMetadata(
        slot_mapping=meta.slot_mapping.cpu(),
        block_tables=meta.block_tables.cpu(),
        seq_lens=meta.seq_lens.cpu(),
        query_start_loc=meta.query_start_loc.cpu(),
        max_query_len=meta.max_query_len,
        max_seq_len=meta.max_seq_len,
        seq_lens_list=meta.seq_lens_list,
        query_lens_list=meta.query_lens_list,
    )


def test_split_step_syncs_nothing():
    """Planning the split stages its index tensors through pinned memory: no host stall."""
    case = _cuda_case(torch.bfloat16)
    args = (case.query, case.key, case.value, case.layer_cache, case.meta, case.scale)
    prefill_attention.attend(*args)  # first use: the one-time flash probe may sync
    case.meta.derived.clear()  # plan again
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        prefill_attention.attend(*args)
    finally:
        torch.cuda.set_sync_debug_mode("default")


NUM_NEW = 12
GREEDY = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_sdpa_engine_fp32_equals_transformers(make_checkpoint, arch):
    path = make_checkpoint(arch)
    prompts = prompts_for(16, 64)
    prompts.append(prompts[2][:40] + [7, 8, 9])  # shares a prefix: a prefix-cache hit
    llm = LLM(_config(path, prefill_attention="sdpa"))
    before = prefill_attention.NUM_CALLS.copy()
    results = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
    assert prefill_attention.NUM_CALLS["sdpa_groups"] > before["sdpa_groups"]
    hf = load_hf_model(path).cuda()
    for prompt, r in zip(prompts, results):
        assert r.token_ids == hf_greedy(hf, prompt, NUM_NEW), f"prompt of {len(prompt)} tokens"
    llm.engine.check_integrity()


def test_bf16_sdpa_takes_flash_and_stays_close_to_triton(make_checkpoint):
    """bf16 tokens may flip at near-ties between two kernels, so compare the hidden states of
    one mixed step (new prompts, a decode, a later chunk) through both paths."""
    model, _ = load_model(make_checkpoint("llama", num_hidden_layers=2), "bfloat16", "cuda")
    assert prefill_attention.use_sdpa_prefills("sdpa", "cuda", torch.bfloat16)
    before = prefill_attention.NUM_CALLS.copy()
    paged, _ = last_step_hidden(model, new_kv_cache(model, "cuda"), sdpa_prefills=False)
    split, _ = last_step_hidden(model, new_kv_cache(model, "cuda"), sdpa_prefills=True)
    assert (prefill_attention.NUM_CALLS - before)["flash_varlen"] > 0
    assert (split - paged).abs().max() <= 2e-2 * paged.abs().max()
