"""The CUDA code path of the models on CPU: every kernel (fused norms, rope + KV write,
SiLU-and-mul, paged attention) through Triton under the interpreter, greedy tokens equal to
the CPU path's and to transformers' (fp32), through chunked prefill and decode."""

from __future__ import annotations

import os
import sys
from collections import Counter

os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of the Triton kernels

import pytest  # noqa: E402
import torch  # noqa: E402

from tandem.wire.engine_protocol import EngineRequest, SamplingParams  # noqa: E402
from tandem.workers.config import EngineConfig  # noqa: E402
from tandem.workers.engine.llm import LLM  # noqa: E402
from tests.workers.hf_checkpoints import load_hf_model  # noqa: E402
from tests.workers.test_engine import hf_greedy  # noqa: E402

NUM_NEW = 3


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_triton_path_tokens_equal_cpu_path_and_transformers(make_checkpoint, monkeypatch, arch):
    path = make_checkpoint(arch, num_hidden_layers=1)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (5, 11)]
    params = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)
    config = EngineConfig.from_flat(
        model=path, block_size=4, max_num_batched_tokens=8, num_kv_blocks=16, dense_decode_bytes=0
    )

    def run() -> list[list[int]]:
        llm = LLM(config)
        results = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        llm.engine.check_integrity()
        return [r.token_ids for r in results]

    cpu_tokens = run()
    monkeypatch.setenv("TANDEM_FORCE_TRITON", "1")
    from tandem.kernels import triton_norm

    assert type(triton_norm._rms_norm_kernel).__name__ == "InterpretedFunction"
    triton_tokens = run()
    hf = load_hf_model(path)
    assert cpu_tokens == [hf_greedy(hf, p, NUM_NEW) for p in prompts]
    assert triton_tokens == cpu_tokens


# Ops that launch no kernel: views, allocations, host-side type logic.
_NO_LAUNCH = {
    "view", "_unsafe_view", "slice", "select", "t", "transpose", "unsqueeze", "expand",
    "permute", "as_strided", "split", "split_with_sizes", "alias", "detach", "detach_",
    "squeeze", "unbind", "reshape", "empty", "empty_like", "new_empty", "empty_strided",
    "promote_types", "resolve_conj", "resolve_neg", "lift_fresh",
}  # fmt: skip


def _decode_step_launches(path: str) -> Counter:
    """Kernel launches one decode step of the CUDA code path enqueues: aten ops that launch
    a kernel plus Triton launches (the interpreter's own torch calls are not counted)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from triton.runtime import interpreter

    counts: Counter = Counter()
    active = [False]

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.__name__.split(".")[0]
            if active[0] and name not in _NO_LAUNCH:
                frame = sys._getframe(1)
                while frame is not None and f"{os.sep}triton{os.sep}" not in (
                    frame.f_code.co_filename
                ):
                    frame = frame.f_back
                if frame is None:
                    counts[name] += 1
            return func(*args, **(kwargs or {}))

    launch = interpreter.InterpretedFunction.__getitem__

    def counted_launch(kernel, grid):
        if active[0]:
            counts["triton:" + kernel.fn.__name__] += 1
        return launch(kernel, grid)

    config = EngineConfig.from_flat(
        model=path, block_size=4, num_kv_blocks=16, dense_decode_bytes=0
    )
    engine = LLM(config.replace(dtype="bfloat16")).engine
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    for i in range(2):
        assert engine.add_request(EngineRequest(f"r{i}", [5 + i] * 6, params)) is None
    engine.step()  # prefill
    interpreter.InterpretedFunction.__getitem__ = counted_launch
    try:
        with Count():
            active[0] = True
            engine.step()  # decode
            active[0] = False
    finally:
        interpreter.InterpretedFunction.__getitem__ = launch
    assert engine.last_step_num_tokens == 2
    while engine.has_work():
        engine.step()
    engine.check_integrity()
    return counts


def test_a_layer_is_nine_launches_on_the_cuda_path(make_checkpoint, monkeypatch):
    """bf16 decode: before the fusion a layer was ~34 launches (RMSNorm alone 6 ops)."""
    monkeypatch.setenv("TANDEM_FORCE_TRITON", "1")
    one = _decode_step_launches(make_checkpoint("llama", num_hidden_layers=1))
    two = _decode_step_launches(make_checkpoint("llama", num_hidden_layers=2))
    per_layer = two - one
    assert per_layer == Counter(
        {
            "linear": 4,  # qkv, o, gate_up, down
            "triton:_rms_norm_kernel": 2,  # both fused with the residual add
            "triton:_rope_write_kv_kernel": 1,
            "triton:_paged_attention_kernel": 1,
            "triton:_silu_and_mul_kernel": 1,
        }
    ), per_layer
    assert (one - two) == Counter()  # nothing per step disappears with a second layer
