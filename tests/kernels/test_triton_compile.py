"""The Triton kernels compiled for a real GPU (sm_90: H100/H200) without one.

The launches are the ones the models make: a model forward on CPU tensors with
``TANDEM_FORCE_TRITON=1`` records each kernel launch instead of running it
(``tests/kernels/triton_aot.py``), for a mixed prefill + decode step and a decode-only step
built by ``AttentionMetadata.build`` (int64 slots) and for a CUDA-graph bucket's static
buffers (int32 ids, positions, slots). Each distinct specialization then goes through Triton's
compiler and ptxas to a cubin: a compile error the interpreter hides, or shared memory beyond
one block's on the GPU, fails here instead of in a GPU session.

CI compiles every kernel of the 1B benchmark model in fp32 / bf16 / fp16, and in bf16 the
attention and rope kernels of other head dims and GQA groups (the GPU tests' tiny models among
them; head dim 80 in fp32 too);
``python -m tests.kernels.triton_aot`` compiles the whole matrix (both KV layouts, sm_80 too).
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels import triton_aot as aot

REASON = aot.aot_unavailable()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"no Triton AOT compile: {REASON}")

ALL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@pytest.fixture(autouse=True)
def compiled_kernels_on_cpu_tensors(monkeypatch):
    monkeypatch.setenv("TANDEM_FORCE_TRITON", "1")
    with aot.compiled_kernel_modules():
        yield


def _compile_all(launches: list[aot.Launch]) -> list[aot.Compiled]:
    return [aot.compile_for(launch, aot.SM90) for launch in aot.unique(launches)]


def test_every_kernel_of_the_benchmark_model_compiles_in_three_dtypes():
    compiled = _compile_all(aot.record_model_launches("llama-3.2-1b", ALL_DTYPES))
    names = {c.name for c in compiled}
    assert names == {
        "_rms_norm_kernel",
        "_rope_write_kv_kernel",
        "_paged_attention_kernel",
        "_silu_and_mul_kernel",
    }
    for pointer in ("*fp32", "*bf16", "*fp16"):  # every dtype reached the compiler
        assert any(pointer in c.signature.values() for c in compiled), pointer
    # the graph buffers' int32 slots and the eager int64 ones both compiled
    slots = {c.signature["slot_mapping_ptr"] for c in compiled if c.name == "_rope_write_kv_kernel"}
    assert slots == {"*i32", "*i64"}
    attention = [c for c in compiled if c.name == "_paged_attention_kernel"]
    assert {c.constexprs["DOT_FP32"] for c in attention} == {True, False}
    assert {c.constexprs["BLOCK_M"] for c in attention} == {16, 64}  # decode and prefill tiles
    assert all(c.constexprs["INTERPRETED"] is False for c in attention)
    assert all(c.cubin_bytes > 0 and c.shared_bytes <= aot.SM90[2] for c in compiled)


@pytest.mark.parametrize(
    "shape",
    ["tiny-llama", "tiny-qwen3-hd24-bias", "llama-hd80-mqa", "qwen2.5-0.5b", "qwen3-0.6b"],
)
def test_attention_and_rope_compile_for_other_head_dims_and_groups(shape):
    """Head dims 16 / 24 / 80 / 128 (padded and masked), GQA groups 2 / 7 / 8, Qwen3's q/k
    norm; the GPU tests' tiny checkpoints among them."""
    # bf16; fp32 (exact dots, the most shared memory) where the head dim is padded
    dtypes = (torch.float32, torch.bfloat16) if shape == "llama-hd80-mqa" else (torch.bfloat16,)
    launches = aot.record_model_launches(shape, dtypes, kinds=("mixed", "decode"))
    keep = {"_paged_attention_kernel", "_rope_write_kv_kernel"}
    if shape.startswith(("tiny-qwen3", "qwen3")):
        keep.add("_rms_norm_kernel")  # over strided [T, heads, D] q/k views
    compiled = _compile_all([launch for launch in launches if launch.name in keep])
    assert {c.name for c in compiled} == keep
    attention = [c for c in compiled if c.name == "_paged_attention_kernel"]
    assert len(attention) == 2 * len(dtypes)  # a prefill tile and a decode tile each


def test_the_standalone_kv_write_compiles():
    from kernels import triton_cache

    with aot.recording() as recorded:
        for dtype in ALL_DTYPES:
            key = torch.zeros(7, 8, 64, dtype=dtype)
            cache = torch.zeros(16, 3, 2, 16, 8, 64, dtype=dtype)[:, 1]  # a layer's view
            for slots in (torch.arange(7), torch.arange(7, dtype=torch.int32)):
                triton_cache.write_kv_cache(key, key.clone(), cache, slots)
    assert len(recorded) == 6
    assert {c.name for c in _compile_all(recorded)} == {"_write_kv_kernel"}


def test_a_compile_error_fails_the_check():
    """Not vacuous: a kernel the compiler refuses (a float offset on a pointer) raises."""
    import triton
    import triton.language as tl

    @triton.jit
    def bad_kernel(x_ptr, N: tl.constexpr):
        offsets = tl.arange(0, N).to(tl.float32)
        tl.store(x_ptr + offsets, 1.0)

    launch = aot.Launch(bad_kernel, (torch.zeros(16),), {"N": 16})
    with pytest.raises(Exception, match="(?i)pointer|float|unsupported|incompatible"):
        aot.compile_for(launch, aot.SM90)
