"""Per-step attention metadata, built once by the model runner and shared by every layer.

Tokens of a step are flat, sequence by sequence::

    query tokens   | s0 t0 t1 t2 | s1 t0 | s2 t0 t1 |
    query_start_loc  0            3      4          6
    seq_lens         [10, 7, 2]   (context INCLUDING this step's tokens)

Token j of sequence i sits at position ``seq_lens[i] - query_lens[i] + j`` and attends to keys
``0..position`` of its sequence, read from the paged cache through ``block_tables[i]``::

    block_tables[i] = [5, 2, 0, 0]   (padded with 0)
    position p lives in slot block_tables[i][p // block_size] * block_size + p % block_size
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch


def host_to_device(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor on ``device``, without stalling the host on CUDA.

    A copy from pageable memory makes the host wait for every kernel already queued (a hidden
    device->host sync); staged through pinned memory it is queued like a kernel (torch's
    pinned allocator keeps the staging block alive until the copy ran). CPU: ``.to(device)``.
    """
    if torch.device(device).type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def list_to_device(
    values: list, device: torch.device | str, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """``torch.tensor(values, dtype=dtype, device=device)`` without the host stall on CUDA."""
    return host_to_device(torch.tensor(values, dtype=dtype), device)


@dataclass
class AttentionMetadata:
    """Everything attention needs to read and write the paged KV cache for one step.

    ``slot_mapping[t]`` is where token ``t``'s K/V is written (-1 skips the write, e.g. padding).
    ``seq_lens_list`` / ``query_lens_list`` are host copies so the CPU path never syncs.
    ``derived`` is a per-step scratch dict where kernels cache index tensors they compute from
    the fields above (shared by all layers of the step); never reuse a metadata across steps
    after mutating its tensors. ``sdpa_prefills``: sequences whose query is their whole context
    attend with SDPA on this step's K/V instead of the paged kernel (``kernels.prefill_attention``).
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64
    block_tables: torch.Tensor  # [num_seqs, max_num_blocks] int32, padded with 0
    seq_lens: torch.Tensor  # [num_seqs] int32
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    max_query_len: int
    max_seq_len: int
    seq_lens_list: list[int]
    query_lens_list: list[int]
    derived: dict[str, Any] = field(default_factory=dict, repr=False)
    sdpa_prefills: bool = False

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_list)

    @property
    def num_query_tokens(self) -> int:
        return sum(self.query_lens_list)

    @classmethod
    def build(
        cls,
        block_tables: list[list[int]],
        seq_lens: list[int],
        query_lens: list[int],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        """Build the metadata from host lists (one entry per sequence, tokens seq by seq).

        Each ``block_tables[i]`` must cover ``seq_lens[i]`` positions
        (``len >= ceil(seq_lens[i] / block_size)``); ``1 <= query_lens[i] <= seq_lens[i]``.
        The slot mapping covers exactly ``sum(query_lens)`` tokens.
        """
        num_seqs = len(seq_lens)
        if len(block_tables) != num_seqs or len(query_lens) != num_seqs:
            raise ValueError("block_tables, seq_lens and query_lens need one entry per sequence")
        # numpy on the host: far cheaper than many small torch ops for these tiny arrays.
        row_lens = np.fromiter(map(len, block_tables), dtype=np.int64, count=num_seqs)
        width = max(int(row_lens.max(initial=0)), 1)
        table = np.zeros((num_seqs, width), dtype=np.int32)
        flat = np.fromiter(itertools.chain.from_iterable(block_tables), dtype=np.int32)
        table[np.arange(width)[None, :] < row_lens[:, None]] = flat

        seq_lens_np = np.asarray(seq_lens, dtype=np.int32)
        query_lens_np = np.asarray(query_lens, dtype=np.int32)
        query_start_loc = np.zeros(num_seqs + 1, dtype=np.int32)
        np.cumsum(query_lens_np, out=query_start_loc[1:])

        # Position of every query token, then its slot through the block table.
        seq_of_token = np.repeat(np.arange(num_seqs), query_lens_np)
        token_idx = np.arange(int(query_start_loc[-1]), dtype=np.int64)
        first_pos = (seq_lens_np - query_lens_np - query_start_loc[:-1]).astype(np.int64)
        positions = first_pos[seq_of_token] + token_idx
        blocks = table[seq_of_token, positions // block_size].astype(np.int64)
        slot_mapping = blocks * block_size + positions % block_size

        def to_device(array: np.ndarray) -> torch.Tensor:
            return host_to_device(torch.from_numpy(array), device)

        return cls(
            slot_mapping=to_device(slot_mapping),
            block_tables=to_device(table),
            seq_lens=to_device(seq_lens_np),
            query_start_loc=to_device(query_start_loc),
            max_query_len=max(query_lens, default=0),
            max_seq_len=max(seq_lens, default=0),
            seq_lens_list=list(seq_lens),
            query_lens_list=list(query_lens),
        )
