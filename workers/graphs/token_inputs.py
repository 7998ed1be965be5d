"""The per-token inputs a piecewise graph reads, refilled in place every step.

A piecewise step is bucketed by its token count T (prefills, chunks and decodes together), so
its inputs are per token, not per sequence. The token ids and positions are built on the host
(pinned on CUDA) and sent with ONE ``non_blocking`` copy; the slots come from the step's
``AttentionMetadata`` (already on the device) by one device copy::

    host/device int32  | input_ids  Tmax | positions Tmax |     Tmax = largest token bucket
    device int32       | slot_mapping Tmax |

Rows past the step's tokens, up to the bucket, are padding: token 0 at position 0 and slot -1
(the KV write skips it); every piece computes row by row, so their rows never reach a real
token's, and the runner drops them.

The host buffer is overwritten by the next ``fill``: ``copy_guard.py`` makes it wait for the
last copy if the GPU has not run it yet (every step of a long chunked prefill samples nothing,
so no read of sampled tokens orders the two).
"""

from __future__ import annotations

import torch

from tandem.workers.graphs.copy_guard import CopyGuard


class StaticTokenInputs:
    """Token ids, positions and KV slots of steps of up to ``max_tokens`` tokens."""

    def __init__(self, max_tokens: int, device: torch.device | str) -> None:
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.max_tokens = max_tokens
        self.device = torch.device(device)
        pin = self.device.type == "cuda"
        self.host = torch.zeros(2 * max_tokens, dtype=torch.int32, pin_memory=pin)
        self.device_buffer = torch.zeros(2 * max_tokens, dtype=torch.int32, device=self.device)
        self.slot_mapping = torch.full((max_tokens,), -1, dtype=torch.int32, device=self.device)
        self._np = self.host.numpy()
        self.copy_guard = CopyGuard(self.device)

    @property
    def num_bytes(self) -> int:
        return (self.device_buffer.numel() + self.slot_mapping.numel()) * 4

    def views(self, size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(input_ids, positions, slot_mapping)``: the first ``size`` rows on the device."""
        t = self.max_tokens
        buf = self.device_buffer
        return buf[:size], buf[t : t + size], self.slot_mapping[:size]

    def fill(
        self,
        input_ids: list[int],
        positions: list[int],
        slot_mapping: torch.Tensor | None,
        size: int,
    ) -> None:
        """Write a step's ``n`` tokens padded to ``size`` rows. ``slot_mapping``: the step's
        ``[n]`` device slots (any int dtype); None with ``n == 0`` (all padding)."""
        n = len(input_ids)
        if len(positions) != n:
            raise ValueError("input_ids and positions need one entry per token")
        if not n <= size <= self.max_tokens:
            raise ValueError(f"size {size} must be in [{n}, {self.max_tokens}]")
        if n and (slot_mapping is None or slot_mapping.shape != (n,)):
            raise ValueError(f"slot_mapping must hold the step's {n} slots")
        t = self.max_tokens
        self.copy_guard.before_write()
        ids, pos = self._np[:t], self._np[t:]
        ids[:n], ids[n:size] = input_ids, 0
        pos[:n], pos[n:size] = positions, 0
        self.device_buffer[: t + size].copy_(self.host[: t + size], non_blocking=True)
        self.copy_guard.after_copy()
        if n:
            self.slot_mapping[:n].copy_(slot_mapping)
        self.slot_mapping[n:size].fill_(-1)
