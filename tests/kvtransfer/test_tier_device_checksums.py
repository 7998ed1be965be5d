"""The host tier's device checksum (kvtransfer/tiers/device_copies.py), checked on CPU
tensors: the same arithmetic runs on CUDA, where the tier computes it (tests/gpu/
test_cuda_kv_tiers.py runs the tier's CUDA path)."""

from __future__ import annotations

import torch

from tandem.kvtransfer.tiers import device_copies
from tandem.kvtransfer.tiers.device_copies import device_checksums

MASK = (1 << 64) - 1


def reference(block: torch.Tensor) -> int:
    """The definition, in Python integers: sum of word_i * weight_i modulo 2**64."""
    words = block.view(torch.int64).tolist()
    weights = device_copies._word_weights(len(words), block.device).tolist()
    total = sum((w & MASK) * (m & MASK) for w, m in zip(words, weights, strict=True)) & MASK
    return total - (1 << 64) if total >= 1 << 63 else total


def test_equals_the_definition_and_chunks_alike(monkeypatch):
    g = torch.Generator().manual_seed(1)
    blocks = torch.randint(0, 256, (7, 4096), generator=g, dtype=torch.uint8)
    want = [reference(b) for b in blocks]
    assert device_checksums(blocks).tolist() == want
    monkeypatch.setattr(device_copies, "CHUNK_BYTES", 3 * 4096)  # three blocks per chunk
    assert device_checksums(blocks).tolist() == want


def test_every_single_bit_flip_and_word_swap_changes_it():
    g = torch.Generator().manual_seed(2)
    block = torch.randint(0, 256, (1, 512), generator=g, dtype=torch.uint8)
    base = device_checksums(block).item()
    for byte in range(512):
        for bit in (0, 3, 7):
            flipped = block.clone()
            flipped[0, byte] ^= 1 << bit
            assert device_checksums(flipped).item() != base, (byte, bit)
    swapped = block.clone().view(torch.int64)
    swapped[0, [0, 1]] = swapped[0, [1, 0]]
    assert device_checksums(swapped.view(torch.uint8)).item() != base
    assert device_checksums(torch.zeros(2, 64, dtype=torch.uint8)).tolist() == [0, 0]
