"""The host tier's gather kernel (kvtransfer/tiers/gather.py) under the Triton interpreter:
rows land byte-exact where the indices say, rows not named stay as they were, and rows
whose size the kernel cannot copy are refused. On CUDA the source is the pinned host tier
(tests/gpu/test_cuda_kv_tiers.py checks that loads went through it)."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of the Triton kernel

import pytest  # noqa: E402
import torch  # noqa: E402

from tandem.kvtransfer.tiers import gather  # noqa: E402


def test_gather_copies_named_rows_byte_exact():
    g = torch.Generator().manual_seed(0)
    row_bytes = 8 * (gather.CHUNK_WORDS + 40)  # two programs per row, the second masked
    src = torch.randint(0, 256, (6, row_bytes), dtype=torch.uint8, generator=g)
    dst = torch.randint(0, 256, (9, row_bytes), dtype=torch.uint8, generator=g)
    before = dst.clone()
    src_rows, dst_rows = [4, 0, 5], [7, 2, 3]
    launches = gather.gather_launches()
    assert gather.gather_rows(src, dst, torch.tensor(src_rows), torch.tensor(dst_rows))
    assert gather.gather_launches() == launches + 1
    for s, d in zip(src_rows, dst_rows, strict=True):
        assert torch.equal(dst[d], src[s])
    untouched = [r for r in range(9) if r not in dst_rows]
    assert torch.equal(dst[untouched], before[untouched])


def test_gather_refuses_rows_it_cannot_copy():
    src, dst = torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(2, 24, dtype=torch.uint8)
    with pytest.raises(ValueError, match="same size"):
        gather.gather_rows(src, dst, torch.tensor([0]), torch.tensor([1]))
    odd = torch.zeros(2, 12, dtype=torch.uint8)
    with pytest.raises(ValueError, match="multiple of 8"):
        gather.gather_rows(odd, odd.clone(), torch.tensor([0]), torch.tensor([1]))
