"""Compiled Triton kernels on a CUDA device against the torch reference, fp32 / bf16 / fp16:
paged attention, KV write (bit-exact), fused RMSNorm (+ residual add: the sum bit-exact),
rope + KV write, SiLU-and-mul. Skipped without CUDA (tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

from tandem.kernels import fused_reference, reference
from tests.kernels.cases import make_case, write_oracle

pytestmark = pytest.mark.gpu

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# compiled kernels round like torch (RNE); what remains is reduction order and exp/rsqrt ulps
TOL = {torch.float32: 3e-6, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}
ATTN_TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 5e-3}
MIXED = [(9, 9), (13, 1), (20, 6), (1, 1), (21, 1), (5, 2), (300, 1), (130, 70)]


def test_kernels_are_compiled_not_interpreted():
    from tandem.kernels import triton_activation, triton_attention, triton_norm, triton_rope_cache

    for kernel in (
        triton_attention._paged_attention_kernel,
        triton_norm._rms_norm_kernel,
        triton_rope_cache._rope_write_kv_kernel,
        triton_activation._silu_and_mul_kernel,
    ):
        assert type(kernel).__name__ == "JITFunction"


def _cuda_case(dtype, heads=(8, 2), head_dim=64, block_size=16, seqs=MIXED):
    case = make_case(seqs, block_size, heads[0], heads[1], head_dim, dtype=dtype)
    case.query, case.key, case.value = (t.cuda() for t in (case.query, case.key, case.value))
    case.kv_cache = case.kv_cache.cuda()
    meta = case.meta
    for name in ("slot_mapping", "block_tables", "seq_lens", "query_start_loc"):
        setattr(meta, name, getattr(meta, name).cuda())
    return case


def _close(actual, expected, tol):
    assert actual.dtype == expected.dtype and actual.is_cuda
    torch.testing.assert_close(actual, expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_cache_bit_exact(dtype):
    from tandem.kernels import dispatch

    case = _cuda_case(dtype)
    case.meta.slot_mapping[[0, 7]] = -1
    expected = case.kv_cache.clone()
    reference.write_kv_cache(case.key, case.value, expected[:, 1], case.meta.slot_mapping)
    dispatch.write_kv_cache(case.key, case.value, case.layer_cache, case.meta.slot_mapping)
    assert torch.equal(case.kv_cache, expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,head_dim", [((8, 2), 64), ((4, 4), 128), ((6, 1), 80)])
def test_paged_attention(dtype, heads, head_dim):
    from tandem.kernels import dispatch

    case = _cuda_case(dtype, heads, head_dim)
    write_oracle(case)
    out = dispatch.paged_attention(case.query, case.layer_cache, case.meta, case.scale)
    expected = reference.paged_attention(case.query, case.layer_cache, case.meta, case.scale)
    _close(out, expected, ATTN_TOL[dtype])


def _randn(*shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).cuda()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [2048, 896, 64])
def test_rms_norm_and_add(dtype, hidden):
    from tandem.kernels import dispatch

    x, residual = _randn(33, hidden, dtype=dtype) * 3, _randn(33, hidden, dtype=dtype, seed=1)
    weight = _randn(hidden, dtype=dtype, seed=2)
    _close(
        dispatch.rms_norm(x, weight, 1e-5), fused_reference.rms_norm(x, weight, 1e-5), TOL[dtype]
    )
    normed, summed = dispatch.add_rms_norm(x, residual, weight, 1e-5)
    ref_normed, ref_summed = fused_reference.add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(summed, ref_summed)
    _close(normed, ref_normed, TOL[dtype])
    heads = _randn(9, 6, 64, dtype=dtype)[:, :4]  # Qwen3 q-norm over a strided view
    head_weight = _randn(64, dtype=dtype, seed=3)
    _close(
        dispatch.rms_norm(heads, head_weight, 1e-6),
        fused_reference.rms_norm(heads, head_weight, 1e-6),
        TOL[dtype],
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_write_kv(dtype):
    case = _cuda_case(dtype)
    case.meta.slot_mapping[3] = -1
    num_tokens, num_heads, head_dim = case.query.shape
    num_kv_heads = case.key.shape[1]
    qkv = torch.cat([case.query, case.key, case.value], dim=1)
    qk, value = qkv[:, : num_heads + num_kv_heads], qkv[:, num_heads + num_kv_heads :]
    positions = torch.randint(0, 4096, (num_tokens,), device="cuda")
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, head_dim, 2, device="cuda") / head_dim))
    freqs = torch.outer(positions.float(), inv_freq)
    cos, sin = freqs.cos().to(dtype).unsqueeze(1), freqs.sin().to(dtype).unsqueeze(1)
    expected_cache = case.kv_cache.clone()
    expected = fused_reference.rope_write_kv(
        qk, value, cos, sin, expected_cache[:, 1], case.meta.slot_mapping
    )
    from tandem.kernels import triton_rope_cache

    out = triton_rope_cache.rope_write_kv(
        qk, value, cos, sin, case.layer_cache, case.meta.slot_mapping
    )
    _close(out, expected, TOL[dtype])
    assert torch.equal(case.kv_cache[:, :, 1], expected_cache[:, :, 1])  # V: a copy
    _close(case.kv_cache[:, :, 0], expected_cache[:, :, 0], TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("intermediate", [8192, 4864, 100])
def test_silu_and_mul(dtype, intermediate):
    from tandem.kernels import dispatch

    gate_up = _randn(17, 2 * intermediate, dtype=dtype) * 4
    out = dispatch.silu_and_mul(gate_up)
    _close(out, fused_reference.silu_and_mul(gate_up.clone()), TOL[dtype])
