"""Triton kernels, run by the Triton interpreter on CPU tensors, against the torch reference."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of the Triton kernels

import pytest  # noqa: E402
import torch  # noqa: E402

from tandem.kernels import dispatch, reference  # noqa: E402
from tests.kernels.cases import make_case, write_oracle  # noqa: E402

MIXED = [(9, 9), (13, 1), (20, 6), (1, 1), (21, 1), (5, 2)]  # prefill/decode/chunk, ragged
DECODE = [(1, 1), (7, 1), (33, 1)]


@pytest.fixture(autouse=True)
def force_triton(monkeypatch):
    monkeypatch.setenv("TANDEM_FORCE_TRITON", "1")


def test_interpreter_is_active():
    from tandem.kernels import triton_attention

    assert type(triton_attention._paged_attention_kernel).__name__ == "InterpretedFunction"


@pytest.mark.parametrize("block_size,num_kv_heads,head_dim", [(4, 2, 48), (16, 1, 80), (16, 4, 32)])
def test_write_kv_cache_matches_oracle_and_skips_minus_one(block_size, num_kv_heads, head_dim):
    case = make_case(MIXED, block_size, 4, num_kv_heads, head_dim)
    case.meta.slot_mapping[[0, 5, 11]] = -1
    expected = case.kv_cache.clone()
    write_oracle(case)
    expected, case.kv_cache = case.kv_cache, expected
    dispatch.write_kv_cache(case.key, case.value, case.layer_cache, case.meta.slot_mapping)
    assert torch.equal(case.kv_cache, expected)


@pytest.mark.parametrize(
    "head_dim,heads,block_size,seqs",
    [
        (32, (4, 4), 4, MIXED),
        (48, (4, 2), 16, MIXED),
        (64, (8, 2), 4, MIXED),
        (80, (4, 1), 16, MIXED),
        (80, (8, 2), 16, DECODE),
        (48, (2, 2), 4, DECODE),
        (32, (8, 1), 16, [(40, 40), (3, 3), (50, 20)]),  # several tiles per seq
    ],
)
def test_attention_matches_reference_fp32(head_dim, heads, block_size, seqs):
    case = make_case(seqs, block_size, heads[0], heads[1], head_dim, seed=head_dim)
    write_oracle(case)
    out = dispatch.paged_attention(case.query, case.layer_cache, case.meta, case.scale)
    expected = reference.paged_attention(case.query, case.layer_cache, case.meta, case.scale)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


def test_attention_padding_rows_are_zero():
    case = make_case(DECODE, 4, 4, 2, 32)
    write_oracle(case)
    padded_query = torch.cat([case.query, torch.randn(2, 4, 32)])
    out = dispatch.paged_attention(padded_query, case.layer_cache, case.meta, case.scale)
    assert torch.equal(out[-2:], torch.zeros(2, 4, 32))


def test_attention_query_with_arbitrary_strides():
    case = make_case(MIXED, 4, 4, 2, 32)
    write_oracle(case)
    qkv = torch.cat([case.query, case.query], dim=1)  # query is then a strided slice
    query = qkv[:, :4]
    assert not query.is_contiguous()
    out = dispatch.paged_attention(query, case.layer_cache, case.meta, case.scale)
    expected = reference.paged_attention(case.query, case.layer_cache, case.meta, case.scale)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_attention_matches_reference_half(dtype):
    case = make_case(MIXED, 16, 8, 2, 48, dtype=dtype)
    dispatch.write_kv_cache(case.key, case.value, case.layer_cache, case.meta.slot_mapping)
    out = dispatch.paged_attention(case.query, case.layer_cache, case.meta, case.scale)
    expected = reference.paged_attention(case.query, case.layer_cache, case.meta, case.scale)
    assert out.dtype == dtype
    torch.testing.assert_close(out, expected, atol=3e-2, rtol=3e-2)
