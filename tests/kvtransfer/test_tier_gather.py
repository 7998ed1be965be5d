"""The host tier's gather kernel (kvtransfer/tiers/gather.py): rows land byte-exact where
the indices say, rows not named stay as they were, and rows whose size the kernel cannot
copy are refused. On CPU under the Triton interpreter; with CUDA as the tier uses it, pinned
host rows read by the device (tests/gpu/test_cuda_kv_tiers.py checks that loads went
through it)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before the first import of the Triton kernel

from tandem.kvtransfer.tiers import gather  # noqa: E402

CUDA = torch.cuda.is_available()


@pytest.fixture(autouse=True)
def gather_on(monkeypatch):
    monkeypatch.setattr(gather, "_enabled", True)


def test_gather_copies_named_rows_byte_exact():
    g = torch.Generator().manual_seed(0)
    row_bytes = 8 * (gather.CHUNK_WORDS + 40)  # two programs per row, the second masked
    src = torch.randint(0, 256, (6, row_bytes), dtype=torch.uint8, generator=g)
    dst = torch.randint(0, 256, (9, row_bytes), dtype=torch.uint8, generator=g)
    before = dst.clone()
    src_rows, dst_rows = torch.tensor([4, 0, 5]), torch.tensor([7, 2, 3])
    if CUDA:  # the tier's case: pinned host rows into device rows
        src, dst = src.pin_memory(), dst.cuda()
        src_rows, dst_rows = src_rows.cuda(), dst_rows.cuda()
    launches = gather.gather_launches()
    assert gather.gather_rows(src, dst, src_rows, dst_rows)
    assert gather.gather_launches() == launches + 1
    dst = dst.cpu()
    for s, d in zip(src_rows.tolist(), dst_rows.tolist(), strict=True):
        assert torch.equal(dst[d], src[s])
    untouched = [r for r in range(9) if r not in dst_rows.tolist()]
    assert torch.equal(dst[untouched], before[untouched])


def test_gather_refuses_rows_it_cannot_copy():
    src, dst = torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(2, 24, dtype=torch.uint8)
    with pytest.raises(ValueError, match="same size"):
        gather.gather_rows(src, dst, torch.tensor([0]), torch.tensor([1]))
    odd = torch.zeros(2, 12, dtype=torch.uint8)
    with pytest.raises(ValueError, match="multiple of 8"):
        gather.gather_rows(odd, odd.clone(), torch.tensor([0]), torch.tensor([1]))
