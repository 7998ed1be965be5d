"""The decode graphs' pinned host buffer on a real device: a refill waits for the copy of the
previous fill when the GPU has not run it yet, so the kernels queued between the two (the
replay) read the first batch, not the second. Skipped without CUDA (tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

from workers.graphs.static_inputs import StaticDecodeInputs

pytestmark = pytest.mark.gpu


def test_refill_waits_for_the_pending_copy():
    inputs = StaticDecodeInputs(4, 8, 16, torch.device("cuda"))
    torch.cuda.synchronize()
    torch.cuda._sleep(500_000_000)  # a few hundred ms of GPU work queued ahead of the copy
    inputs.fill([11, 12], [3, 20], [[1], [2, 5]], [4, 21], 2)
    assert not inputs.copy_done.query()  # the copy is still queued behind the sleep
    seen = inputs.device_view("input_ids", 4).clone()  # like the replay: reads what was sent
    seen_slots = inputs.device_view("slot_mapping", 4).clone()
    inputs.fill([21, 22, 23], [0, 1, 2], [[3], [3], [3]], [1, 2, 3], 4)
    torch.cuda.synchronize()
    assert seen.tolist() == [11, 12, 0, 0]
    assert seen_slots.tolist() == [1 * 16 + 3, 5 * 16 + 4, 0, 0]  # rows 2-3: never filled
    assert inputs.device_view("input_ids", 4).tolist() == [21, 22, 23, 0]
