"""The Triton kernels compiled for a real GPU (sm_90: H100/H200) without one.

The launches are the ones the models make: a model forward on CPU tensors with
``TANDEM_FORCE_TRITON=1`` records each kernel launch instead of running it
(``tests/kernels/triton_aot.py``), for a mixed prefill + decode step and a decode-only step
built by ``AttentionMetadata.build`` (int64 slots) and for a CUDA-graph bucket's static
buffers (int32 ids, positions, slots). Each distinct specialization then goes through Triton's
compiler and ptxas to a cubin: a compile error the interpreter hides, or shared memory beyond
one block's on the GPU, fails here instead of in a GPU session.

The compiles run in a child process (``python -m tests.kernels.triton_aot --json``): this
pytest process interprets kernels elsewhere, and Triton cannot compile and interpret in one
process. The subset: every kernel of the 1B benchmark model in fp32 / bf16 / fp16; attention
and rope (and Qwen3's q/k norm) of other head dims and GQA groups in bf16 (head dim 80 in
fp32 too), the GPU tests' tiny models among them; the standalone KV write. The whole matrix
(both KV layouts, sm_80 too): ``python -m tests.kernels.triton_aot``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.long  # tens of seconds: started early (tests/conftest.py)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OTHER_SHAPES = [
    "tiny-llama",
    "tiny-qwen3-hd24-bias",
    "llama-hd80-mqa",
    "qwen2.5-0.5b",
    "qwen3-0.6b",
]
SM90_SHARED_BYTES = 232448


@pytest.fixture(scope="module")
def ci() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET",)}
    done = subprocess.run(
        [sys.executable, "-m", "tests.kernels.triton_aot", "--json"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if result["unavailable"] is not None:
        pytest.skip(f"no Triton AOT compile: {result['unavailable']}")
    return result


def _compiled(ci: dict, case: str) -> list[dict]:
    entries = ci["cases"][case]
    errors = [e for e in entries if "error" in e]
    assert not errors, errors
    assert all(0 < e["cubin_bytes"] and e["shared_bytes"] <= SM90_SHARED_BYTES for e in entries)
    return entries


def test_every_kernel_of_the_benchmark_model_compiles_in_three_dtypes(ci):
    compiled = _compiled(ci, "llama-3.2-1b")
    assert {c["name"] for c in compiled} == {
        "_rms_norm_kernel",
        "_rope_write_kv_kernel",
        "_paged_attention_kernel",
        "_silu_and_mul_kernel",
    }
    pointers = {v for c in compiled for v in c["signature"].values() if v.startswith("*")}
    assert {"*fp32", "*bf16", "*fp16"} <= pointers  # every dtype reached the compiler
    # the graph buffers' int32 slots and the eager int64 ones both compiled
    rope = [c for c in compiled if c["name"] == "_rope_write_kv_kernel"]
    assert {c["signature"]["slot_mapping_ptr"] for c in rope} == {"*i32", "*i64"}
    attention = [c["constexprs"] for c in compiled if c["name"] == "_paged_attention_kernel"]
    assert {c["DOT_FP32"] for c in attention} == {True, False}
    assert {c["BLOCK_M"] for c in attention} == {16, 64}  # decode and prefill tiles
    assert all(c["INTERPRETED"] is False for c in attention)


@pytest.mark.parametrize("shape", OTHER_SHAPES)
def test_attention_and_rope_compile_for_other_head_dims_and_groups(ci, shape):
    """Head dims 16 / 24 / 80 / 128 (padded and masked), GQA groups 2 / 7 / 8, Qwen3's q/k
    norm over strided [T, heads, D] views."""
    compiled = _compiled(ci, shape)
    expected = {"_paged_attention_kernel", "_rope_write_kv_kernel"}
    if "qwen3" in shape:
        expected.add("_rms_norm_kernel")
    assert {c["name"] for c in compiled} == expected
    num_dtypes = 2 if shape == "llama-hd80-mqa" else 1
    attention = [c for c in compiled if c["name"] == "_paged_attention_kernel"]
    assert len(attention) == 2 * num_dtypes  # a prefill tile and a decode tile each


def test_the_standalone_kv_write_compiles(ci):
    compiled = _compiled(ci, "kv-write")
    assert {c["name"] for c in compiled} == {"_write_kv_kernel"}
    assert {c["signature"]["slot_mapping_ptr"] for c in compiled} == {"*i32", "*i64"}


def test_a_compile_error_fails_the_check(ci):
    """Not vacuous: the compiler refuses a kernel with a float offset on a pointer."""
    error = ci["bad_kernel_error"]
    assert error is not None, "the compiler accepted a float pointer offset"
    assert error.startswith("CompilationError") and "pointer" in error, error
