"""Dense decode KV: the CPU fast path for decode attention.

On CPU, paged decode attention spends most of its time gathering every sequence's blocks
into contiguous K/V, in every layer of every step. Here each decoding request also owns a
row of a dense copy of its KV, filled from the paged cache once when the request starts
decoding, then extended by one position per step, so decode attention reads contiguous
memory and gathers nothing::

    keys    [layer, row, kv_head, head_dim, position]   K stored transposed: q @ K^T is a
    values  [layer, row, kv_head, position, head_dim]   plain row-major matmul (2x faster)

    row 0  | req a: positions 0..130 |........  lengths[0] = 131
    row 1  | req c: positions 0..97  |........  lengths[1] = 98
    row 2  | (free)                             lengths[2] = 0      positions < capacity

The paged cache stays the source of truth (every token is still written there): a row is
only a copy, dropped whenever its request stops decoding (finished, preempted, scheduled
with more than one token) and refilled from the paged cache when it decodes again. The copy
is bounded by ``max_bytes``; decodes that do not fit take the paged path. Growing it (new
rows or a longer capacity) allocates, zeroes and copies the whole copy inside one step
(50-200 ms at tens of MiB on a busy CPU), so it is kept at its size while rows come and go
and given back only after ``idle_release_s`` with no row in use (``release_if_idle``, called
by the engine loop when it has nothing to run).

Per step, ``DenseDecodeKV.prepare`` assigns rows and returns a ``DenseDecodeStep`` whose
``attend`` runs one layer: fill new rows, append this token's K/V at (row, position), then
attention over rows ``[0, num_rows)`` in two batched matmuls with GQA folded (the query
heads of one KV head are the rows of one matrix) and an additive mask hiding positions past
each row's length.

Speculative decoding verifies a request's last token and its drafts as one query of
``1 + k`` consecutive positions (``workers/runner/spec_step.py``); such a query also takes a
row. Each row then has up to T query slots, the score matrices are ``[rows * Hkv, T *
group, len]``, and each slot's mask ends at its own position (causal inside the query). A
verification that rejected drafts leaves the row longer than the request's computed tokens:
the next step truncates it (positions before the computed ones hold the KV of accepted
tokens, which is the KV of the request's tokens), so no refill is needed.
"""

from __future__ import annotations

import heapq
import time

import torch

_CAPACITY_QUANTUM = 128  # positions; capacity grows in multiples of this (or doubles)


class DenseDecodeStep:
    """One step's dense decode attention, shared by every layer.

    Token ``i`` of the step's dense decodes (in the order ``DenseDecodeKV.prepare``
    returned) sits in row ``rows[i]`` at position ``positions[i]``; ``fills`` are
    ``(row, num_positions, block_ids)`` of rows to copy from the paged cache first.
    """

    def __init__(
        self,
        cache: DenseDecodeKV,
        rows: list[int],
        positions: list[int],
        fills: list[tuple[int, int, torch.Tensor]],
        slots: list[int] | None = None,
    ) -> None:
        self.cache = cache
        self.fills = fills
        self.num_tokens = len(rows)
        self.num_segments = len(set(rows))
        # multi-token queries: token i sits in query slot slots[i] of its row
        self.multi = None if slots is None else _MultiTokenQueries(cache, rows, positions, slots)
        self.num_rows = max(rows) + 1  # attention runs over rows [0, num_rows)
        self.identity = rows == list(range(self.num_rows))
        self.rows = torch.tensor(rows, dtype=torch.long)
        pos = torch.tensor(positions, dtype=torch.long)
        self.positions = pos
        # row (row, head, pos) of values[layer] viewed as [rows * Hkv * capacity, D]
        row_heads = self.rows[:, None] * cache.num_kv_heads + torch.arange(cache.num_kv_heads)
        self.value_idx = (row_heads * cache.capacity + pos[:, None]).view(-1)

        # prepare() already set this step's lengths; idle rows in range attend to something
        # finite (at least one position) and their output is dropped
        lengths = torch.tensor(cache.lengths[: self.num_rows], dtype=torch.long).clamp_(min=1)
        self.max_len = int(lengths.max())
        mask = torch.zeros(self.num_rows, self.max_len, dtype=cache.dtype)
        mask.masked_fill_(torch.arange(self.max_len)[None, :] >= lengths[:, None], float("-inf"))
        num_kv_heads, group = cache.num_kv_heads, cache.num_heads_per_kv
        # [rows * Hkv, group, max_len]: the shape of the score matrices
        self.mask = (
            mask[:, None, None, :]
            .expand(self.num_rows, num_kv_heads, group, self.max_len)
            .reshape(self.num_rows * num_kv_heads, group, self.max_len)
        )

    def attend(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_cache: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """Append ``k``/``v`` ``[N, Hkv, D]`` to the rows and attend ``q`` ``[N, Hq, D]``.

        New rows are first filled from ``layer_cache`` (this layer of the paged cache, this
        step's K/V already written): their context may have been computed earlier in this
        very step (a prefix-cache hit on blocks another request of the step prefills).
        Returns ``[N, Hq, D]`` in ``q``'s dtype.
        """
        cache = self.cache
        for row, num_positions, block_ids in self.fills:
            cache.fill_layer(layer_idx, row, num_positions, block_ids, layer_cache)
        keys, values = cache.keys[layer_idx], cache.values[layer_idx]
        keys[self.rows, :, :, self.positions] = k.to(cache.dtype)  # a column per (row, head)
        values.view(-1, cache.head_dim).index_copy_(
            0, self.value_idx, v.to(cache.dtype).reshape(-1, cache.head_dim)
        )

        if self.multi is not None:
            return self.multi.attend(q, keys, values, scale)
        out_dtype = q.dtype
        num_tokens, num_heads, head_dim = q.shape
        num_rows, max_len = self.num_rows, self.max_len
        batch = num_rows * cache.num_kv_heads
        q = q.to(cache.dtype)
        if not self.identity:
            q = q.new_zeros(num_rows, num_heads, head_dim).index_copy_(0, self.rows, q)
        q = q.reshape(batch, cache.num_heads_per_kv, head_dim)
        keys_t = keys[:num_rows].view(batch, head_dim, -1)[:, :, :max_len]
        scores = torch.baddbmm(self.mask, q, keys_t, alpha=scale)
        probs = torch.softmax(scores, dim=-1)
        out = torch.bmm(probs, values[:num_rows].view(batch, -1, head_dim)[:, :max_len])
        out = out.view(num_rows, num_heads, head_dim)
        if not self.identity:
            out = out.index_select(0, self.rows)
        return out.to(out_dtype)


class _MultiTokenQueries:
    """Attention of a step whose rows hold up to T consecutive query tokens each."""

    def __init__(
        self, cache: DenseDecodeKV, rows: list[int], positions: list[int], slots: list[int]
    ) -> None:
        self.cache = cache
        self.num_rows = max(rows) + 1
        self.num_slots = max(slots) + 1
        self.slot_idx = torch.tensor(rows, dtype=torch.long) * self.num_slots + torch.tensor(
            slots, dtype=torch.long
        )
        # per (row, slot): the positions it sees end at its own (empty slots see position 0)
        seen = torch.ones(self.num_rows * self.num_slots, dtype=torch.long)
        seen.index_copy_(0, self.slot_idx, torch.tensor(positions, dtype=torch.long) + 1)
        self.max_len = int(seen.max())
        mask = torch.zeros(self.num_rows, self.num_slots, self.max_len, dtype=cache.dtype)
        mask.masked_fill_(
            torch.arange(self.max_len) >= seen.view(self.num_rows, self.num_slots, 1),
            float("-inf"),
        )
        hkv, group = cache.num_kv_heads, cache.num_heads_per_kv
        self.mask = (
            mask[:, None, :, None, :]
            .expand(self.num_rows, hkv, self.num_slots, group, self.max_len)
            .reshape(self.num_rows * hkv, self.num_slots * group, self.max_len)
        )

    def attend(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float
    ) -> torch.Tensor:
        cache = self.cache
        out_dtype = q.dtype
        _, num_heads, head_dim = q.shape
        rows, slots, max_len = self.num_rows, self.num_slots, self.max_len
        hkv, group = cache.num_kv_heads, cache.num_heads_per_kv
        batch = rows * hkv
        full = q.new_zeros(rows * slots, num_heads, head_dim, dtype=cache.dtype)
        full.index_copy_(0, self.slot_idx, q.to(cache.dtype))
        full = full.view(rows, slots, hkv, group, head_dim).transpose(1, 2)
        full = full.reshape(batch, slots * group, head_dim)
        keys_t = keys[:rows].view(batch, head_dim, -1)[:, :, :max_len]
        scores = torch.baddbmm(self.mask, full, keys_t, alpha=scale)
        probs = torch.softmax(scores, dim=-1)
        out = torch.bmm(probs, values[:rows].view(batch, -1, head_dim)[:, :max_len])
        out = out.view(rows, hkv, slots, group, head_dim).transpose(1, 2)
        out = out.reshape(rows * slots, num_heads, head_dim).index_select(0, self.slot_idx)
        return out.to(out_dtype)


class DenseDecodeKV:
    """Rows of dense KV for decoding requests (see module docstring).

    The model runner calls ``prepare`` once per step and ``release`` whenever a request
    stops decoding. Not thread-safe (one runner owns it).
    """

    def __init__(
        self,
        kv_cache: torch.Tensor,
        num_heads: int,
        max_bytes: int,
        idle_release_s: float = 5.0,
    ) -> None:
        _, num_layers, _, block_size, num_kv_heads, head_dim = kv_cache.shape
        self.num_layers = num_layers
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.num_heads_per_kv = num_heads // num_kv_heads
        self.dtype = kv_cache.dtype
        self.max_bytes = max_bytes
        self.idle_release_s = idle_release_s
        self._idle_since: float | None = None  # monotonic time the last row was released
        self.bytes_per_position = num_layers * 2 * num_kv_heads * head_dim * kv_cache.element_size()
        self.capacity = 0
        self.keys = kv_cache.new_zeros(num_layers, 0, num_kv_heads, head_dim, 0)
        self.values = kv_cache.new_zeros(num_layers, 0, num_kv_heads, 0, head_dim)
        self.lengths: list[int] = []  # positions held per row
        self.row_of: dict[str, int] = {}
        self._free_rows: list[int] = []  # heap: lowest row first keeps the used rows compact

    @property
    def num_rows(self) -> int:
        return self.keys.shape[1]

    def release(self, req_id: str) -> None:
        """Forget ``req_id``'s row (no-op without one). The memory stays (see
        ``release_if_idle``)."""
        row = self.row_of.pop(req_id, None)
        if row is None:
            return
        self.lengths[row] = 0
        heapq.heappush(self._free_rows, row)
        if not self.row_of:
            self._idle_since = time.monotonic()

    def release_if_idle(self, now_s: float) -> bool:
        """Free the copy if no row has been in use for ``idle_release_s``."""
        if self.row_of or self.capacity == 0:
            return False
        if self._idle_since is None:  # rows were never taken since the last growth
            self._idle_since = now_s
        if now_s - self._idle_since < self.idle_release_s:
            return False
        self._idle_since = None
        self._free_rows = []
        self._resize(0, 0)
        return True

    def order(
        self, decodes: list[tuple], indices: list[int], num_queries: int
    ) -> tuple[list[int], DenseDecodeStep | None]:
        """``prepare`` for a step of ``num_queries`` queries, of which ``decodes`` are the
        candidates (``indices``: their places among the queries): the queries' order with
        those that take dense rows first (by row), then the rest, and the step (None, and
        the order unchanged, when none fit the budget)."""
        everything = list(range(num_queries))
        chosen, step = self.prepare(decodes)
        if step is None:
            return everything, None
        first = [indices[c] for c in chosen]
        taken = set(first)
        return first + [i for i in everything if i not in taken], step

    def prepare(self, decodes: list[tuple]) -> tuple[list[int], DenseDecodeStep | None]:
        """Give rows to this step's decode queries ``(req_id, position, block_ids)``, or
        ``(req_id, position, block_ids, num_tokens)`` for a query of ``num_tokens``
        consecutive positions from ``position`` on (a speculative verification).

        Returns the indices into ``decodes`` that take the dense path, ordered by row, and
        the step (None when none fit the budget). Rows new to their request get positions
        ``0..position-1`` copied from the paged cache layer by layer in ``attend``; a row
        longer than ``position`` (rejected drafts) is cut back to it.
        """
        if not decodes:
            return [], None
        counts = [d[3] if len(d) > 3 else 1 for d in decodes]
        needed_len = max(d[1] + n for d, n in zip(decodes, counts))
        if needed_len > self.capacity:
            self._grow(needed_len)
        chosen: list[tuple[int, int]] = []  # (row, index into decodes)
        fills: list[tuple[int, int, torch.Tensor]] = []
        for i, (req_id, pos, block_ids, *_) in enumerate(decodes):
            if pos + counts[i] > self.capacity:
                self.release(req_id)
                continue
            row = self.row_of.get(req_id)
            if row is None:
                row = self._take_row()
                if row is None:
                    continue
                self.row_of[req_id] = row
            if self.lengths[row] < pos:
                num_blocks = -(-pos // self.block_size)
                fills.append((row, pos, torch.tensor(block_ids[:num_blocks], dtype=torch.long)))
            self.lengths[row] = pos + counts[i]  # this step appends positions pos..
            chosen.append((row, i))
        if not chosen:
            return [], None
        self._idle_since = None
        chosen.sort()
        rows, positions, slots = [], [], []
        for row, i in chosen:
            for t in range(counts[i]):
                rows.append(row)
                positions.append(decodes[i][1] + t)
                slots.append(t)
        multi = slots if max(counts[i] for _, i in chosen) > 1 else None
        return [i for _, i in chosen], DenseDecodeStep(self, rows, positions, fills, multi)

    def fill_layer(
        self,
        layer_idx: int,
        row: int,
        num_positions: int,
        block_ids: torch.Tensor,
        layer_cache: torch.Tensor,
    ) -> None:
        """Copy positions ``0..num_positions-1`` of ``row`` from the paged ``layer_cache``
        (``block_ids``: the row's first ``ceil(num_positions / block_size)`` blocks)."""
        blocks = layer_cache.index_select(0, block_ids)  # [W, 2, bs, Hkv, D]
        seq = blocks.permute(1, 3, 0, 2, 4).reshape(2, self.num_kv_heads, -1, self.head_dim)
        n = num_positions
        self.keys[layer_idx, row, :, :, :n] = seq[0, :, :n].transpose(1, 2)
        self.values[layer_idx, row, :, :n] = seq[1, :, :n]

    def _take_row(self) -> int | None:
        if self._free_rows:
            return heapq.heappop(self._free_rows)
        num_rows = self.num_rows
        new_rows = max(8, 2 * num_rows)
        while new_rows > num_rows and not self._fits(new_rows, self.capacity):
            new_rows -= 1
        if new_rows == num_rows:
            return None
        self._resize(new_rows, self.capacity)
        for row in range(num_rows + 1, new_rows):
            heapq.heappush(self._free_rows, row)
        return num_rows

    def _grow(self, needed_len: int) -> None:
        """Raise the capacity to hold ``needed_len`` positions, if the budget allows."""
        quantum = _CAPACITY_QUANTUM
        num_rows = max(self.num_rows, 1)
        for capacity in (max(needed_len, 2 * self.capacity), needed_len):
            capacity = -(-capacity // quantum) * quantum
            if self._fits(num_rows, capacity):
                self._resize(self.num_rows, capacity)
                return

    def _fits(self, num_rows: int, capacity: int) -> bool:
        return num_rows * capacity * self.bytes_per_position <= self.max_bytes

    def _resize(self, num_rows: int, capacity: int) -> None:
        rows, length = min(num_rows, self.num_rows), min(capacity, self.capacity)
        keys = self.keys.new_zeros(
            self.num_layers, num_rows, self.num_kv_heads, self.head_dim, capacity
        )
        keys[:, :rows, :, :, :length] = self.keys[:, :rows, :, :, :length]
        values = self.values.new_zeros(
            self.num_layers, num_rows, self.num_kv_heads, capacity, self.head_dim
        )
        values[:, :rows, :, :length] = self.values[:, :rows, :, :length]
        lengths = self.lengths[:rows] + [0] * (num_rows - rows)
        self.keys, self.values, self.lengths, self.capacity = keys, values, lengths, capacity
