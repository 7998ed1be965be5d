"""Torch reference (the CPU path) against a naive per-token float64 oracle."""

from __future__ import annotations

import pytest
import torch

from tandem.kernels import AttentionMetadata, paged_attention, reference, write_kv_cache
from tests.kernels.cases import attention_oracle, make_case, write_oracle

MIXED = [(9, 9), (13, 1), (20, 6), (1, 1), (37, 37), (17, 1), (5, 2)]  # prefill/decode/chunk
DECODE = [(1, 1), (7, 1), (16, 1), (33, 1), (64, 1)]
PREFILL = [(3, 3), (16, 16), (29, 29)]
SIMILAR = [(20, 8), (24, 7), (18, 8), (30, 6), (9, 9), (8, 8), (14, 1), (12, 1)]  # padded groups
LONG = [(70, 70), (100, 66), (5, 1), (9, 3)]  # queries past SHORT_QUERY_LEN, one with a prefix


def test_build_metadata_matches_python():
    tables = [[4, 1, 7], [2], [0, 5, 3, 6]]
    seq_lens, query_lens, block_size = [10, 3, 13], [2, 3, 1], 4
    meta = AttentionMetadata.build(tables, seq_lens, query_lens, block_size, "cpu")
    slots = []
    for table, s, q in zip(tables, seq_lens, query_lens, strict=True):
        slots += [table[p // block_size] * block_size + p % block_size for p in range(s - q, s)]
    assert meta.slot_mapping.tolist() == slots
    assert meta.slot_mapping.dtype == torch.int64
    assert meta.block_tables.tolist() == [[4, 1, 7, 0], [2, 0, 0, 0], [0, 5, 3, 6]]
    assert meta.block_tables.dtype == torch.int32
    assert meta.query_start_loc.tolist() == [0, 2, 5, 6]
    assert meta.seq_lens.tolist() == seq_lens and meta.seq_lens.dtype == torch.int32
    assert (meta.max_query_len, meta.max_seq_len) == (3, 13)
    assert (meta.seq_lens_list, meta.query_lens_list) == (seq_lens, query_lens)


@pytest.mark.parametrize("block_size", [4, 16])
def test_write_kv_cache_matches_oracle_and_skips_minus_one(block_size):
    case = make_case(MIXED, block_size, 4, 2, 48)
    case.meta.slot_mapping[[0, 5, 11]] = -1
    expected = case.kv_cache.clone()
    write_oracle(case)
    expected, case.kv_cache = case.kv_cache, expected
    write_kv_cache(case.key, case.value, case.layer_cache, case.meta.slot_mapping)
    assert torch.equal(case.kv_cache, expected)


@pytest.mark.parametrize(
    "head_dim,heads",
    [(32, (4, 4)), (48, (4, 2)), (64, (8, 2)), (80, (4, 4)), (80, (8, 2)), (48, (2, 1))],
)
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize(
    "seqs", [MIXED, DECODE, PREFILL, SIMILAR], ids=["mixed", "decode", "prefill", "similar"]
)
def test_attention_matches_oracle_fp32(head_dim, heads, block_size, seqs):
    case = make_case(seqs, block_size, heads[0], heads[1], head_dim, seed=head_dim + block_size)
    write_kv_cache(case.key, case.value, case.layer_cache, case.meta.slot_mapping)
    out = paged_attention(case.query, case.layer_cache, case.meta, case.scale)
    assert out.shape == case.query.shape and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), attention_oracle(case), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_attention_matches_oracle_half(dtype):
    case = make_case(MIXED, 16, 8, 2, 64, dtype=dtype)
    write_kv_cache(case.key, case.value, case.layer_cache, case.meta.slot_mapping)
    out = paged_attention(case.query, case.layer_cache, case.meta, case.scale)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), attention_oracle(case), atol=3e-2, rtol=3e-2)


def test_padding_rows_are_zero_and_plan_is_shared_across_layers():
    case = make_case(DECODE, 4, 4, 2, 32)
    write_kv_cache(case.key, case.value, case.layer_cache, case.meta.slot_mapping)
    padded_query = torch.cat([case.query, torch.randn(3, 4, 32)])
    out = paged_attention(padded_query, case.layer_cache, case.meta, case.scale)
    assert torch.equal(out[-3:], torch.zeros(3, 4, 32))
    torch.testing.assert_close(out[:-3].double(), attention_oracle(case), atol=2e-5, rtol=2e-5)
    assert len(case.meta.derived) == 1
    again = reference.paged_attention(case.query, case.layer_cache, case.meta, case.scale)
    assert torch.equal(again, out[:-3])


def test_ragged_decodes_split_into_groups_match_oracle():
    lens = [3, 70, 5, 64, 2, 33, 1, 40, 9, 17, 80, 4]
    case = make_case([(n, 1) for n in lens] + [(12, 5)], 4, 4, 2, 32)
    write_kv_cache(case.key, case.value, case.layer_cache, case.meta.slot_mapping)
    out = paged_attention(case.query, case.layer_cache, case.meta, case.scale)
    plan = case.meta.derived[("attention_plan", 4)]
    assert len(plan.groups) > 2 and not plan.long_queries
    torch.testing.assert_close(out.double(), attention_oracle(case), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("head_dim,heads,block_size", [(48, (4, 2), 16), (32, (4, 4), 4)])
def test_long_queries_match_oracle(head_dim, heads, block_size):
    case = make_case(LONG, block_size, heads[0], heads[1], head_dim)
    write_kv_cache(case.key, case.value, case.layer_cache, case.meta.slot_mapping)
    out = paged_attention(case.query, case.layer_cache, case.meta, case.scale)
    plan = case.meta.derived[("attention_plan", block_size)]
    assert len(plan.long_queries) == 2
    torch.testing.assert_close(out.double(), attention_oracle(case), atol=2e-5, rtol=2e-5)


def test_similar_short_queries_share_padded_groups():
    case = make_case(SIMILAR, 16, 4, 2, 32)
    write_kv_cache(case.key, case.value, case.layer_cache, case.meta.slot_mapping)
    out = paged_attention(case.query, case.layer_cache, case.meta, case.scale)
    plan = case.meta.derived[("attention_plan", 16)]
    assert [(g.num_seqs, g.query_len) for g in plan.groups] == [(2, 1), (6, 9)]
    assert plan.groups[1].valid_pos is not None
    torch.testing.assert_close(out.double(), attention_oracle(case), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("seqs", [MIXED, DECODE, LONG], ids=["mixed", "decode", "long"])
def test_query_slice_of_fused_projection(seqs):
    case = make_case(seqs, 4, 4, 2, 32)
    write_kv_cache(case.key, case.value, case.layer_cache, case.meta.slot_mapping)
    qkv = torch.cat([case.query, case.key, case.value], dim=1)  # [T, Hq + 2 Hkv, D]
    query = qkv[:, :4]
    assert not query.is_contiguous()
    out = paged_attention(query, case.layer_cache, case.meta, case.scale)
    expected = paged_attention(case.query, case.layer_cache, case.meta, case.scale)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("seqs", [DECODE * 3, SIMILAR * 2], ids=["decode", "similar"])
def test_large_groups_gathered_in_chunks_match_oracle(monkeypatch, seqs):
    monkeypatch.setattr(reference, "_GATHER_BUDGET_BYTES", 1)  # chunks of _MIN_CHUNK_SEQS
    case = make_case(seqs, 4, 4, 2, 32)
    write_kv_cache(case.key, case.value, case.layer_cache, case.meta.slot_mapping)
    out = paged_attention(case.query, case.layer_cache, case.meta, case.scale)
    plan = case.meta.derived[("attention_plan", 4)]
    assert max(g.num_seqs for g in plan.groups) > reference._MIN_CHUNK_SEQS
    torch.testing.assert_close(out.double(), attention_oracle(case), atol=2e-5, rtol=2e-5)
