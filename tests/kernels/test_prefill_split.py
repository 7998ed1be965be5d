"""The prefill split (``kernels.prefill_attention``) on CPU: prefix-free prefills through SDPA
on their own K/V, every other sequence through the Triton paged kernel under the interpreter,
against the float64 oracle and the torch reference."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of the Triton kernels

import pytest  # noqa: E402
import torch  # noqa: E402

from tandem.kernels import prefill_attention, reference  # noqa: E402
from tests.kernels.cases import attention_oracle, make_case, write_oracle  # noqa: E402

# (seq_len, query_len): fresh prompts of lengths 9, 1, 5, 5 (two of one length, not adjacent),
# a decode, a chunk after a first chunk (prefix in the cache), a prefix hit.
MIXED = [(9, 9), (13, 1), (5, 5), (20, 6), (1, 1), (5, 5), (30, 14)]
ALL_FRESH = [(7, 7), (3, 3), (7, 7)]


@pytest.fixture(autouse=True)
def force_triton(monkeypatch):
    monkeypatch.setenv("TANDEM_FORCE_TRITON", "1")


def _split_case(seqs, heads, head_dim, block_size=4, dtype=torch.float32, seed=0):
    case = make_case(seqs, block_size, heads[0], heads[1], head_dim, dtype=dtype, seed=seed)
    write_oracle(case)
    case.meta.sdpa_prefills = True
    return case


@pytest.mark.parametrize("heads,head_dim", [((4, 4), 32), ((8, 2), 48), ((4, 1), 16)])
def test_mixed_step_matches_the_oracle(heads, head_dim):
    case = _split_case(MIXED, heads, head_dim, seed=head_dim)
    before = prefill_attention.NUM_CALLS.copy()
    out = prefill_attention.attend(
        case.query, case.key, case.value, case.layer_cache, case.meta, case.scale
    )
    assert prefill_attention.NUM_CALLS - before == {"sdpa_groups": 1}
    split = prefill_attention.get_split(case.meta)
    assert split.paged.query_lens_list == [1, 6, 14]  # decode, chunk, prefix hit stay paged
    assert [(g.length, g.num_seqs) for g in split.groups] == [(9, 1), (5, 2), (1, 1)]
    torch.testing.assert_close(out.double(), attention_oracle(case), atol=2e-5, rtol=2e-5)
    expected = reference.paged_attention(case.query, case.layer_cache, case.meta, case.scale)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


def test_only_fresh_prompts_need_no_cache_read():
    case = _split_case(ALL_FRESH, (4, 2), 32)
    case.layer_cache.fill_(float("nan"))  # the split must not read the cache at all
    out = prefill_attention.attend(
        case.query, case.key, case.value, case.layer_cache, case.meta, case.scale
    )
    clean = _split_case(ALL_FRESH, (4, 2), 32)
    expected = reference.paged_attention(clean.query, clean.layer_cache, clean.meta, clean.scale)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


def test_padding_rows_are_zero_and_bf16_is_close():
    case = _split_case(MIXED, (4, 2), 32, dtype=torch.bfloat16, seed=3)
    pad = 3
    query = torch.cat((case.query, torch.ones(pad, *case.query.shape[1:], dtype=torch.bfloat16)))
    key = torch.cat((case.key, torch.ones(pad, *case.key.shape[1:], dtype=torch.bfloat16)))
    value = torch.cat((case.value, torch.ones(pad, *case.value.shape[1:], dtype=torch.bfloat16)))
    out = prefill_attention.attend(query, key, value, case.layer_cache, case.meta, case.scale)
    assert out.dtype == torch.bfloat16 and out.shape == query.shape
    assert torch.equal(out[-pad:], torch.zeros_like(out[-pad:]))
    expected = reference.paged_attention(query, case.layer_cache, case.meta, case.scale)
    torch.testing.assert_close(out.float(), expected.float(), atol=3e-2, rtol=3e-2)


def test_off_or_without_fresh_sequences_it_is_the_paged_kernel():
    decodes = _split_case([(13, 1), (20, 6)], (4, 2), 32)
    assert prefill_attention.get_split(decodes.meta) is None
    off = _split_case(MIXED, (4, 2), 32)
    off.meta.sdpa_prefills = False
    assert prefill_attention.get_split(off.meta) is None


def test_modes():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    use = prefill_attention.use_sdpa_prefills
    # auto = the paged kernel: the H200 rows (use_sdpa_prefills' docstring)
    for device in (cpu, cuda):
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            assert not use("auto", device, dtype)
    assert use("sdpa", cpu, torch.float32) and not use("triton", cuda, torch.bfloat16)
    with pytest.raises(ValueError, match="prefill_attention"):
        use("flash", cpu, torch.float32)


def test_flash_varlen_call_matches_torchs_schema():
    """The varlen flash call (CUDA only) checked on the meta device: this torch accepts its
    arguments and returns ``[T, Hq, D]`` for GQA operands strided like the model's q/k/v."""
    qkv = torch.empty(10, 8 + 2 * 2, 64, device="meta", dtype=torch.bfloat16)
    q, k, v = qkv[:, :8], qkv[:, 8:10], qkv[:, 10:]
    cu_seqlens = torch.tensor([0, 4, 10], dtype=torch.int32, device="meta")
    out = prefill_attention._flash_varlen(q, k, v, cu_seqlens, 6, 0.125)
    assert out.shape == (10, 8, 64) and out.dtype == torch.bfloat16
