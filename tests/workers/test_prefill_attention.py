"""``--prefill-attention sdpa`` through the CUDA code path on CPU (Triton under the interpreter):
prefix-free prefills attend with SDPA on their own K/V while decodes, later chunks and prefix
hits use the paged kernel; greedy tokens equal transformers' and the plain path's, and a mixed
step's hidden states stay close to the all-paged step's."""

from __future__ import annotations

import argparse
import os

os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of the Triton kernels

import pytest  # noqa: E402
import torch  # noqa: E402

from tandem.kernels import prefill_attention  # noqa: E402
from tandem.wire.engine_protocol import SamplingParams  # noqa: E402
from tandem.workers.checkpoints.loader import load_model  # noqa: E402
from tandem.workers.config import EngineConfig, add_engine_arguments, engine_overrides  # noqa: E402
from tandem.workers.engine.llm import LLM  # noqa: E402
from tests.workers.hf_checkpoints import load_hf_model  # noqa: E402
from tests.workers.mixed_steps import (  # noqa: E402
    SMALL_STEPS,
    SMALL_TABLES,
    last_step_hidden,
    new_kv_cache,
)
from tests.workers.test_engine import hf_greedy  # noqa: E402

NUM_NEW = 3


@pytest.fixture(autouse=True)
def force_triton(monkeypatch):
    monkeypatch.setenv("TANDEM_FORCE_TRITON", "1")


@pytest.mark.parametrize(
    "arch,dense_decode_bytes,paged_kernel",
    [("llama", 0, "triton"), ("qwen3", None, "triton"), ("llama", 0, "reference")],
)
def test_sdpa_split_tokens_equal_transformers(
    make_checkpoint, monkeypatch, arch, dense_decode_bytes, paged_kernel
):
    """Chunked prefill (budget 8: a first chunk is fresh, the next one paged), decodes in the
    same steps, then a prompt that hits the prefix cache (paged); with the CPU dense-decode
    rows too (qwen3: dense_decode_bytes default); the rest through the interpreted Triton
    kernel or the CPU reference."""
    if paged_kernel == "reference":
        monkeypatch.delenv("TANDEM_FORCE_TRITON")
    path = make_checkpoint(arch, num_hidden_layers=1)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (5, 11, 1)]
    later = [prompts[1][:8] + [9, 10]]  # shares two full blocks with prompts[1]
    params = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)
    config = EngineConfig.from_flat(
        model=path,
        block_size=4,
        max_num_batched_tokens=8,
        num_kv_blocks=32,
        prefill_attention="sdpa",
        dense_decode_bytes=dense_decode_bytes,
    )
    llm = LLM(config)
    assert llm.engine.runner.sdpa_prefills
    before = prefill_attention.NUM_CALLS.copy()
    results = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    results += llm.generate(prompt_token_ids=later, sampling_params=params)
    assert prefill_attention.NUM_CALLS["sdpa_groups"] > before["sdpa_groups"]
    assert results[-1].num_cached_tokens == 8  # the later prompt attended through the cache
    llm.engine.check_integrity()
    hf = load_hf_model(path)
    assert [r.token_ids for r in results] == [hf_greedy(hf, p, NUM_NEW) for p in prompts + later]


def test_mixed_step_hidden_states_close_to_all_paged(make_checkpoint):
    model, _ = load_model(make_checkpoint("llama", num_hidden_layers=2), "float32")
    small = {"steps": SMALL_STEPS, "tables": SMALL_TABLES}
    paged, _ = last_step_hidden(model, new_kv_cache(model), False, **small)
    split, meta = last_step_hidden(model, new_kv_cache(model), True, **small)
    assert prefill_attention.get_split(meta).paged.query_lens_list == [1, 17]
    torch.testing.assert_close(split, paged, atol=1e-5, rtol=1e-5)


def test_flag_and_field_errors():
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    args = parser.parse_args(["--prefill-attention", "sdpa"])
    assert engine_overrides(args) == {"prefill_attention": "sdpa"}
    assert EngineConfig.from_flat(**engine_overrides(args)).graphs.prefill_attention == "sdpa"
    with pytest.raises(ValueError, match="prefill_attention must be one of auto, triton, sdpa"):
        EngineConfig.from_flat(prefill_attention="flash")
