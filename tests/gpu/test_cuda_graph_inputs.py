"""The graphs' pinned host buffers on a real device (workers/graphs/copy_guard.py): a refill
waits for the copy of the previous fill when the GPU has not run it yet, so the kernels queued
between the two (the replay) read the first step's inputs, not the second's. Without the guard
the first copy, still queued behind the GPU's work, would send the second step's. Skipped
without CUDA (tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

from tandem.workers.graphs.static_inputs import StaticDecodeInputs
from tandem.workers.graphs.token_inputs import StaticTokenInputs

pytestmark = pytest.mark.gpu

BUSY_CYCLES = 500_000_000  # a few hundred ms of GPU work queued ahead of the first copy


def test_decode_inputs_refill_waits_for_the_pending_copy():
    inputs = StaticDecodeInputs(4, 8, 16, torch.device("cuda"))
    torch.cuda.synchronize()
    torch.cuda._sleep(BUSY_CYCLES)
    inputs.fill([11, 12], [3, 20], [[1], [2, 5]], [4, 21], 2)
    assert not inputs.copy_guard.event.query()  # the copy is still queued behind the sleep
    seen = inputs.device_view("input_ids", 4).clone()  # like the replay: reads what was sent
    seen_slots = inputs.device_view("slot_mapping", 4).clone()
    inputs.fill([21, 22, 23], [0, 1, 2], [[3], [3], [3]], [1, 2, 3], 4)
    torch.cuda.synchronize()
    assert seen.tolist() == [11, 12, 0, 0]
    assert seen_slots.tolist() == [1 * 16 + 3, 5 * 16 + 4, 0, 0]  # rows 2-3: never filled
    assert inputs.device_view("input_ids", 4).tolist() == [21, 22, 23, 0]


def test_token_inputs_refill_waits_for_the_pending_copy():
    """The piecewise graphs' inputs: every step of a chunked prefill samples nothing, so
    nothing else orders the next fill after this copy."""
    inputs = StaticTokenInputs(8, torch.device("cuda"))
    slots = torch.arange(100, 105, device="cuda")
    torch.cuda.synchronize()
    torch.cuda._sleep(BUSY_CYCLES)
    inputs.fill([5, 6, 7, 8, 9], [0, 1, 2, 3, 4], slots, 8)
    assert not inputs.copy_guard.event.query()
    ids, positions, slot_view = (t.clone() for t in inputs.views(8))
    inputs.fill([1, 2, 3, 4, 5], [5, 6, 7, 8, 9], slots + 5, 8)
    torch.cuda.synchronize()
    assert ids.tolist() == [5, 6, 7, 8, 9, 0, 0, 0]
    assert positions.tolist() == [0, 1, 2, 3, 4, 0, 0, 0]
    assert slot_view.tolist() == [100, 101, 102, 103, 104, -1, -1, -1]
    assert inputs.views(8)[1].tolist() == [5, 6, 7, 8, 9, 0, 0, 0]
