"""Fused Triton layer ops (RMSNorm, add+RMSNorm, rope+KV write, SiLU-and-mul) run by the Triton
interpreter on CPU tensors, against the torch reference (the CPU path)."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of the Triton kernels

import pytest  # noqa: E402
import torch  # noqa: E402

from tandem.kernels import dispatch, fused_reference  # noqa: E402
from tests.kernels.cases import make_case  # noqa: E402

HALF = [torch.float16, torch.bfloat16]
# fp32: reductions in another order only; half: one rounding of the output dtype apart.
# The interpreter casts float32 -> bfloat16 by truncation (compiled kernels round to nearest
# even), so interpreted bf16 results may sit one bf16 step from torch's: 2**-7 relative.
TOL = {torch.float32: 2e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


@pytest.fixture(autouse=True)
def force_triton(monkeypatch):
    monkeypatch.setenv("TANDEM_FORCE_TRITON", "1")


def _randn(*shape: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    tol = TOL[expected.dtype]
    torch.testing.assert_close(actual, expected, atol=tol, rtol=tol)


def test_fused_kernels_run_interpreted():
    from tandem.kernels import triton_activation, triton_norm, triton_rope_cache

    for kernel in (
        triton_norm._rms_norm_kernel,
        triton_rope_cache._rope_write_kv_kernel,
        triton_activation._silu_and_mul_kernel,
    ):
        assert type(kernel).__name__ == "InterpretedFunction"


@pytest.mark.parametrize("dtype", [torch.float32, *HALF])
@pytest.mark.parametrize("hidden", [64, 48])
def test_rms_norm(dtype, hidden):
    x = _randn(7, hidden, dtype=dtype) * 3
    weight = _randn(hidden, dtype=dtype, seed=1)
    _close(dispatch.rms_norm(x, weight, 1e-5), fused_reference.rms_norm(x, weight, 1e-5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_of_strided_heads(dtype):
    """Qwen3's q/k norm reads heads out of the fused QKV output: a strided 3-D view."""
    qkv = _randn(5, 4 + 2 * 2, 32, dtype=dtype)
    q = qkv[:, :4]
    assert not q.is_contiguous()
    weight = _randn(32, dtype=dtype, seed=2)
    _close(dispatch.rms_norm(q, weight, 1e-6), fused_reference.rms_norm(q, weight, 1e-6))


@pytest.mark.parametrize("dtype", [torch.float32, *HALF])
def test_add_rms_norm_returns_norm_and_exact_sum(dtype):
    x, residual = _randn(6, 80, dtype=dtype), _randn(6, 80, dtype=dtype, seed=3)
    weight = _randn(80, dtype=dtype, seed=4)
    normed, summed = dispatch.add_rms_norm(x, residual, weight, 1e-5)
    ref_normed, ref_summed = fused_reference.add_rms_norm(x, residual, weight, 1e-5)
    if dtype == torch.bfloat16:  # interpreter truncation (see TOL); exact on the GPU
        _close(summed, ref_summed)
    else:
        assert torch.equal(summed, ref_summed)  # one rounding of the same sum: bit-exact
    _close(normed, ref_normed)


def _rope_tables(num_tokens: int, head_dim: int, dtype: torch.dtype):
    positions = torch.tensor([3, 0, 17, 5, 9, 1, 30, 2][:num_tokens])
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.outer(positions.float(), inv_freq)
    return freqs.cos().to(dtype).unsqueeze(1), freqs.sin().to(dtype).unsqueeze(1)


@pytest.mark.parametrize("dtype", [torch.float32, *HALF])
@pytest.mark.parametrize("heads,head_dim", [((4, 2), 32), ((3, 1), 48), ((2, 2), 16)])
def test_rope_write_kv(dtype, heads, head_dim):
    num_heads, num_kv_heads = heads
    case = make_case([(9, 4), (6, 1), (3, 3)], 4, num_heads, num_kv_heads, head_dim, dtype=dtype)
    case.meta.slot_mapping[2] = -1  # padding: rotated, never written
    num_tokens = case.query.shape[0]
    qkv = torch.cat([case.query, case.key, case.value], dim=1)  # the fused projection's layout
    qk, value = qkv[:, : num_heads + num_kv_heads], qkv[:, num_heads + num_kv_heads :]
    cos, sin = _rope_tables(num_tokens, head_dim, dtype)
    expected_cache = case.kv_cache.clone()
    expected = fused_reference.rope_write_kv(
        qk, value, cos, sin, expected_cache[:, 1], case.meta.slot_mapping
    )
    out = dispatch.rope_write_kv(qk, value, cos, sin, case.layer_cache, case.meta.slot_mapping)
    _close(out, expected)
    # V and every slot the step does not write are copied bit for bit; K equals the rotation.
    keys = case.kv_cache[:, :, 0]
    assert torch.equal(case.kv_cache[:, :, 1], expected_cache[:, :, 1])
    _close(keys, expected_cache[:, :, 0])
    assert torch.equal(case.kv_cache[:, [0, 2]], expected_cache[:, [0, 2]])


@pytest.mark.parametrize("dtype", [torch.float32, *HALF])
@pytest.mark.parametrize("intermediate", [96, 1100])
def test_silu_and_mul(dtype, intermediate):
    gate_up = _randn(5, 2 * intermediate, dtype=dtype) * 4
    out = dispatch.silu_and_mul(gate_up)
    expected = fused_reference.silu_and_mul(gate_up.clone())
    _close(out, expected)


def test_bad_shapes_name_the_problem():
    with pytest.raises(ValueError, match="silu_and_mul"):
        dispatch.silu_and_mul(torch.zeros(2, 5))
    with pytest.raises(ValueError, match="head_dim"):
        cache = torch.zeros(2, 2, 4, 1, 6)
        dispatch.rope_write_kv(
            torch.zeros(1, 2, 5), torch.zeros(1, 1, 5), torch.zeros(1, 1, 2),
            torch.zeros(1, 1, 2), cache, torch.zeros(1, dtype=torch.long),
        )  # fmt: skip
