"""The input buffers a captured decode graph reads, refilled in place every step.

A graph replays fixed device addresses, so a step's token ids, positions, slots, sequence
lengths and block tables are written into the same device tensors each time. They live in one
int32 buffer, built on the host (pinned memory on CUDA) and sent with ``non_blocking``
copies of what the batch uses::

    device | input_ids B | positions B | slot_mapping B | seq_lens B | query_start_loc B+1 |
           | block_tables B x W                                                            |
    host   | the same 5B+1 header, then the step's table corner b x w, compact             |
      B = largest captured batch, W = blocks of the longest sequence (max_model_len / block_size)
      b = this step's bucket, w = blocks of the step's longest table (at least 1)

The header goes in one copy; the table's used corner ``[:b, :w]`` in a second (a contiguous
pinned source into a strided destination: on CUDA torch stages it through a device temporary,
still without a host wait). The graph keeps reading the whole ``B x W`` table, but the kernels
read row ``i`` only up to column ``ceil(seq_lens[i] / block_size) - 1`` (the Triton kernel masks
its block-table loads by ``seq_len``; the reference slices each row to its width), so the stale
columns past ``w`` from longer earlier steps are never read. At a 128k context with 16-token
blocks a full table is 8 MiB per step at B = 256; a step of 256 sequences of 2k tokens copies
128 KiB.

Rows past the real batch, up to the bucket, are padding: token 0 at position 0, slot -1 (the
KV write skips it), sequence length 1 over block 0 (attention reads one finite cache row; the
output row is dropped; columns ``[0, w)`` of padded rows are zeroed every step, ``w >= 1``).
``query_start_loc`` is ``0..B``, set once: decodes have one query token.

The host buffer is overwritten by the next ``fill``: the copy must have run by then, which
``copy_guard.py`` ensures (the step's sampled-token read usually has; a step that samples
nothing or an overlapped loop would not).

Verification graphs (``verify.py``) use a second instance with more token rows than sequence
rows (``max_tokens``): a step's sequences carry up to Q query tokens each (a decode token and
its drafts), so ``input_ids``, ``positions`` and ``slot_mapping`` hold T tokens while
``seq_lens``, ``query_start_loc`` and the table hold S sequences. ``fill_queries`` writes
``query_start_loc`` every step (the real cumulative query lengths, then the total repeated:
padding sequences have no query token and the kernel skips them); padding tokens past the
real ones are token 0 at position 0 with slot -1, and belong to no sequence, so attention
leaves their rows unwritten (whatever the pool held; every later op is row by row and the
rows are dropped).
"""

from __future__ import annotations

import itertools

import numpy as np
import torch

from tandem.kernels import AttentionMetadata
from tandem.workers.graphs.copy_guard import CopyGuard


class StaticDecodeInputs:
    """Pinned host + device int32 buffers for decode batches of up to ``max_batch`` rows."""

    def __init__(
        self,
        max_batch: int,
        max_blocks_per_seq: int,
        block_size: int,
        device: torch.device,
        max_tokens: int | None = None,
    ) -> None:
        if max_batch < 1 or max_blocks_per_seq < 1:
            raise ValueError("max_batch and max_blocks_per_seq must be >= 1")
        t = max_batch if max_tokens is None else max_tokens
        if t < max_batch:
            raise ValueError("max_tokens must be >= max_batch")
        self.max_batch = max_batch
        self.max_tokens = t
        self.max_blocks_per_seq = max_blocks_per_seq
        self.block_size = block_size
        self.device = torch.device(device)
        b, w = max_batch, max_blocks_per_seq
        self._sections = {
            "input_ids": (0, t),
            "positions": (t, 2 * t),
            "slot_mapping": (2 * t, 3 * t),
            "seq_lens": (3 * t, 3 * t + b),
            "query_start_loc": (3 * t + b, 3 * t + 2 * b + 1),
        }
        self._table_start = 3 * t + 2 * b + 1
        total = self._table_start + b * w
        pin = self.device.type == "cuda"
        self.host = torch.zeros(total, dtype=torch.int32, pin_memory=pin)
        self.device_buffer = torch.zeros(total, dtype=torch.int32, device=self.device)
        self._np = self.host.numpy()
        self._host_view("query_start_loc")[:] = np.arange(b + 1, dtype=np.int32)
        self.device_buffer.copy_(self.host)  # the table starts all zeros: block 0 everywhere
        self.num_copied_bytes = 0  # of the last fill (tests, benchmarks)
        self.copy_guard = CopyGuard(self.device)

    # ---- views -----------------------------------------------------------------------

    def _host_view(self, name: str) -> np.ndarray:
        start, end = self._sections[name]
        return self._np[start:end]

    def _host_table(self, batch: int, width: int) -> np.ndarray:
        """The host's compact ``[batch, width]`` corner (row stride ``width``, not W)."""
        start = self._table_start
        return self._np[start : start + batch * width].reshape(batch, width)

    def device_view(self, name: str, batch: int) -> torch.Tensor:
        """First ``batch`` rows of a device section (``query_start_loc``: ``batch + 1``;
        ``input_ids``, ``positions`` and ``slot_mapping`` count tokens, the others sequences)."""
        start, _ = self._sections[name]
        extra = 1 if name == "query_start_loc" else 0
        return self.device_buffer[start : start + batch + extra]

    def block_tables(self, batch: int) -> torch.Tensor:
        w = self.max_blocks_per_seq
        table = self.device_buffer[self._table_start :].view(self.max_batch, w)
        return table[:batch]

    def metadata(self, batch: int) -> AttentionMetadata:
        """Attention metadata over the device views of a ``batch``-row bucket.

        Built once per bucket and captured with its graph: its tensors are the static views;
        its host lists describe an all-padding batch (the Triton kernels read only the tensors
        and ``max_query_len``, which is 1 for every decode batch).
        """
        return AttentionMetadata(
            slot_mapping=self.device_view("slot_mapping", batch),
            block_tables=self.block_tables(batch),
            seq_lens=self.device_view("seq_lens", batch),
            query_start_loc=self.device_view("query_start_loc", batch),
            max_query_len=1,
            max_seq_len=1,
            seq_lens_list=[1] * batch,
            query_lens_list=[1] * batch,
        )

    def query_metadata(self, seqs: int, tokens: int, max_query_len: int) -> AttentionMetadata:
        """Attention metadata of a verification bucket: ``seqs`` sequence rows, ``tokens``
        token rows, queries of up to ``max_query_len`` tokens (the kernel's grid and tiles are
        fixed by it at capture). Its host lists only size the batch (``tokens`` query tokens in
        all, so the kernel zeroes no padding rows); the kernels read the tensors."""
        if not 1 <= seqs <= min(tokens, self.max_batch) or tokens > self.max_tokens:
            raise ValueError(f"bucket of {seqs} sequences and {tokens} tokens does not fit")
        base, extra = divmod(tokens, seqs)
        return AttentionMetadata(
            slot_mapping=self.device_view("slot_mapping", tokens),
            block_tables=self.block_tables(seqs),
            seq_lens=self.device_view("seq_lens", seqs),
            query_start_loc=self.device_view("query_start_loc", seqs),
            max_query_len=max_query_len,
            max_seq_len=1,
            seq_lens_list=[1] * seqs,
            query_lens_list=[base + 1] * extra + [base] * (seqs - extra),
        )

    # ---- per step --------------------------------------------------------------------

    def fill(
        self,
        input_ids: list[int],
        positions: list[int],
        block_tables: list[list[int]],
        seq_lens: list[int],
        batch: int,
    ) -> None:
        """Write a decode batch (one token per sequence) padded to ``batch`` rows, then copy
        the header and the table's used corner to the device (``non_blocking``; pinned host
        memory on CUDA)."""
        n = len(input_ids)
        if not (len(positions) == len(block_tables) == len(seq_lens) == n):
            raise ValueError("input_ids, positions, block_tables and seq_lens need n entries each")
        if not n <= batch <= self.max_batch:
            raise ValueError(f"batch {batch} must be in [{n}, {self.max_batch}]")
        row_lens = self._row_lens(block_tables)
        self.copy_guard.before_write()
        ids, pos = self._host_view("input_ids"), self._host_view("positions")
        slots, lens = self._host_view("slot_mapping"), self._host_view("seq_lens")
        used = max(int(row_lens.max(initial=0)), 1)  # columns this step's kernels may read
        table = self._host_table(batch, used)
        ids[:n], ids[n:batch] = input_ids, 0
        pos[:n], pos[n:batch] = positions, 0
        lens[:n], lens[n:batch] = seq_lens, 1
        self._write_table_and_slots(block_tables, row_lens, table, np.arange(n))
        slots[n:batch] = -1
        self._send(batch, used)

    def fill_queries(
        self,
        input_ids: list[int],
        positions: list[int],
        block_tables: list[list[int]],
        seq_lens: list[int],
        query_lens: list[int],
        seqs: int,
        tokens: int,
    ) -> None:
        """Write a batch of ``n`` sequences with ``query_lens[i] >= 1`` query tokens each (the
        last ones of the sequence; tokens flat, sequence by sequence) padded to ``seqs``
        sequence rows and ``tokens`` token rows (module docstring), then copy as ``fill``."""
        n, total = len(seq_lens), len(input_ids)
        if not (len(block_tables) == len(query_lens) == n and len(positions) == total):
            raise ValueError(
                "block_tables, seq_lens and query_lens need n entries, positions one per token"
            )
        if not (n <= seqs <= self.max_batch and total <= tokens <= self.max_tokens):
            raise ValueError(f"{n} sequences / {total} tokens do not fit {seqs} / {tokens}")
        if sum(query_lens) != total:
            raise ValueError("query_lens must add up to the number of input ids")
        row_lens = self._row_lens(block_tables)
        self.copy_guard.before_write()
        ids, pos = self._host_view("input_ids"), self._host_view("positions")
        slots, lens = self._host_view("slot_mapping"), self._host_view("seq_lens")
        starts = self._host_view("query_start_loc")
        used = max(int(row_lens.max(initial=0)), 1)
        table = self._host_table(seqs, used)
        ids[:total], ids[total:tokens] = input_ids, 0
        pos[:total], pos[total:tokens] = positions, 0
        lens[:n], lens[n:seqs] = seq_lens, 1
        starts[0] = 0
        np.cumsum(np.asarray(query_lens, dtype=np.int32), out=starts[1 : n + 1])
        starts[n + 1 : seqs + 1] = total
        seq_of_token = np.repeat(np.arange(n), query_lens)
        self._write_table_and_slots(block_tables, row_lens, table, seq_of_token)
        slots[total:tokens] = -1
        self._send(seqs, used)

    def _write_table_and_slots(
        self,
        block_tables: list[list[int]],
        row_lens: np.ndarray,
        table: np.ndarray,
        seq_of_token: np.ndarray,
    ) -> None:
        """The host table corner (rows zeroed past each row's blocks) and the slot of each
        of the ``len(seq_of_token)`` real tokens, from the positions already written."""
        table[:] = 0
        n, num_tokens = len(row_lens), len(seq_of_token)
        if not n:
            return
        used = table.shape[1]
        flat = np.fromiter(
            itertools.chain.from_iterable(block_tables), dtype=np.int32, count=int(row_lens.sum())
        )
        table[:n][np.arange(used)[None, :] < row_lens[:, None]] = flat
        positions = self._host_view("positions")[:num_tokens].astype(np.int64)
        blocks = table[seq_of_token, positions // self.block_size].astype(np.int64)
        slots = self._host_view("slot_mapping")
        slots[:num_tokens] = blocks * self.block_size + positions % self.block_size

    def _row_lens(self, block_tables: list[list[int]]) -> np.ndarray:
        row_lens = np.fromiter(map(len, block_tables), dtype=np.int64, count=len(block_tables))
        width = self.max_blocks_per_seq
        if len(row_lens) and int(row_lens.max()) > width:
            raise ValueError(
                f"a block table has {int(row_lens.max())} blocks, more than the {width} "
                "the graph buffers hold (max_model_len / block_size)"
            )
        return row_lens

    def _send(self, seqs: int, used: int) -> None:
        """The header and the table's used corner ``[:seqs, :used]`` to the device."""
        start = self._table_start
        self.device_buffer[:start].copy_(self.host[:start], non_blocking=True)
        host_corner = self.host[start : start + seqs * used].view(seqs, used)
        self.block_tables(seqs)[:, :used].copy_(host_corner, non_blocking=True)
        self.copy_guard.after_copy()
        self.num_copied_bytes = (start + seqs * used) * 4
