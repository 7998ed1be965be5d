"""Logprobs of the sampled tokens, computed on the device inside the step and read back with
the sampled tokens: no second device->host wait per step.

    step stream (device), right after sampling        loop thread (host), at finish
    log_softmax of the raw rows that asked (R rows)
    logprob of each row's sampled id (on the device)
    top-K ids and values, by value desc then id asc
    per row: how many logprobs are >= its n-th top
    packed [R, 2 + 2K] float64 -> pinned host copy --> the step's one event wait (with the
                                                       sampled ids, workers/runner/async_step.py)
                                                       -> one tolist of host memory

    packed row j | sampled logprob | count >= n-th | K top ids | K top logprobs |

float64 holds every float32 logprob and every token id exactly. One case reads the device
again: a row whose n-th place is tied with a value outside its top K (exact ties only) is
redone on the device to pick the lower ids, as ``_finish_top`` says.
"""

from __future__ import annotations

import torch

from tandem.kernels.metadata import list_to_device
from tandem.wire.engine_protocol import Logprobs, SamplingParams


def top_on_device(
    logprobs: torch.Tensor, num_tops: list[int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(ids, values, num_at_least)`` without reading anything back: each row's top
    ``max(num_tops)`` ids and values sorted by value descending, then id ascending, and how
    many of the row's logprobs are >= its ``num_tops[j]``-th value."""
    max_top = max(num_tops)
    values, ids = logprobs.topk(max_top, dim=-1)
    # topk's order among equal values is unspecified: re-sort by id, then stably by value.
    by_id = ids.argsort(dim=-1)
    ids, values = ids.gather(1, by_id), values.gather(1, by_id)
    by_value = values.argsort(dim=-1, descending=True, stable=True)
    ids, values = ids.gather(1, by_value), values.gather(1, by_value)
    n_index = list_to_device([max(n - 1, 0) for n in num_tops], logprobs.device)
    nth_value = values.gather(1, n_index.unsqueeze(1))
    return ids, values, (logprobs >= nth_value).sum(dim=-1)


def finish_top(
    logprobs: torch.Tensor,
    id_lists: list[list[int]],
    value_lists: list[list[float]],
    num_at_least: list[int],
    num_tops: list[int],
) -> tuple[list[list[int]], list[list[float]]]:
    """Cut each row's host lists to its ``num_tops[j]``. A tie across the n-th place may
    have made topk pick a higher id than an equal value outside its result: such rows are
    redone exactly on ``logprobs`` (a device read, exact ties only)."""
    for j, n in enumerate(num_tops):
        if n and num_at_least[j] > n:
            nth_value = value_lists[j][n - 1]
            candidates = (logprobs[j] >= nth_value).nonzero().squeeze(1)
            candidate_values = logprobs[j].index_select(0, candidates)
            order = candidate_values.argsort(descending=True, stable=True)[:n]
            id_lists[j] = candidates.index_select(0, order).tolist()
            value_lists[j] = candidate_values.index_select(0, order).tolist()
        else:
            id_lists[j], value_lists[j] = id_lists[j][:n], value_lists[j][:n]
    return id_lists, value_lists


class DeviceLogprobs:
    """A step's sample logprobs on the device, packed for one host copy (module doc)."""

    __slots__ = ("rows", "num_tops", "num_params", "logprobs", "packed", "host")

    def __init__(
        self, raw_logits: torch.Tensor, params: list[SamplingParams], sampled: torch.Tensor
    ) -> None:
        """``raw_logits`` ``[N, V]`` float, ``sampled`` ``[N]`` ids on the same device; at
        least one of ``params`` asks for logprobs. Queues device work only."""
        self.rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        if not self.rows:
            raise ValueError("no row of params asks for logprobs")
        self.num_params = len(params)
        device = raw_logits.device
        rows_t = list_to_device(self.rows, device)
        self.logprobs = torch.log_softmax(raw_logits.index_select(0, rows_t), -1)
        vocab_size = self.logprobs.shape[1]
        self.num_tops = [min(params[i].logprobs, vocab_size) for i in self.rows]
        chosen = sampled.index_select(0, rows_t).long().unsqueeze(1)
        columns = [self.logprobs.gather(1, chosen)]
        if max(self.num_tops) > 0:
            ids, values, num_at_least = top_on_device(self.logprobs, self.num_tops)
            columns += [num_at_least.unsqueeze(1), ids, values]
        else:
            columns.append(torch.zeros_like(columns[0]))
        self.packed = torch.cat([c.to(torch.float64) for c in columns], dim=1)
        self.host: torch.Tensor | None = None

    def copy_to_host(self) -> None:
        """Queue the packed table's copy into pinned host memory (CUDA; the caller records
        the event that ``build`` is read after)."""
        if self.packed.is_cuda:
            self.host = torch.empty(self.packed.shape, dtype=self.packed.dtype, pin_memory=True)
            self.host.copy_(self.packed, non_blocking=True)

    def build(self, token_ids: list[int]) -> list[Logprobs | None]:
        """One entry per row of the step (None where not asked). On CUDA call it after the
        step's event: it reads the pinned copy."""
        table = (self.host if self.host is not None else self.packed).tolist()
        k = (len(table[0]) - 2) // 2
        id_lists = [[int(t) for t in row[2 : 2 + k]] for row in table]
        value_lists = [row[2 + k :] for row in table]
        num_at_least = [int(row[1]) for row in table]
        if k:
            id_lists, value_lists = finish_top(
                self.logprobs, id_lists, value_lists, num_at_least, self.num_tops
            )
        result: list[Logprobs | None] = [None] * self.num_params
        for j, i in enumerate(self.rows):
            result[i] = Logprobs(
                token_id=token_ids[i],
                logprob=table[j][0],
                top_token_ids=id_lists[j],
                top_logprobs=value_lists[j],
            )
        return result
