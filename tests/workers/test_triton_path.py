"""The CUDA code path of the models on CPU: every kernel (fused norms, rope + KV write,
SiLU-and-mul, paged attention) through Triton under the interpreter, greedy tokens equal to
the CPU path's and to transformers' (fp32), through chunked prefill and decode."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of the Triton kernels

import pytest  # noqa: E402
import torch  # noqa: E402

from scheduler.messages import SamplingParams  # noqa: E402
from tests.workers.hf_checkpoints import load_hf_model  # noqa: E402
from tests.workers.test_engine import hf_greedy  # noqa: E402
from workers.config import EngineConfig  # noqa: E402
from workers.llm import LLM  # noqa: E402

NUM_NEW = 3


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_triton_path_tokens_equal_cpu_path_and_transformers(make_checkpoint, monkeypatch, arch):
    path = make_checkpoint(arch, num_hidden_layers=1)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (5, 11)]
    params = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)
    config = EngineConfig(
        model=path, block_size=4, max_num_batched_tokens=8, num_kv_blocks=16, dense_decode_bytes=0
    )

    def run() -> list[list[int]]:
        llm = LLM(config)
        results = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        llm.engine.check_integrity()
        return [r.token_ids for r in results]

    cpu_tokens = run()
    monkeypatch.setenv("TANDEM_FORCE_TRITON", "1")
    from kernels import triton_norm

    assert type(triton_norm._rms_norm_kernel).__name__ == "InterpretedFunction"
    triton_tokens = run()
    hf = load_hf_model(path)
    assert cpu_tokens == [hf_greedy(hf, p, NUM_NEW) for p in prompts]
    assert triton_tokens == cpu_tokens
