"""Piecewise CUDA graphs: a step's forward as captured pieces, attention eager between them.

A full graph replays one fixed batch shape, which fits decode-only batches (one query token
per sequence). A step with a prefill or a chunk has per-step query lengths, so its attention
cannot be captured; everything around attention can, because it only works row by row over
the step's T tokens. The step is padded to a token bucket and run as L + 1 pieces::

    piece 0       embed, rope, layer 0 up to attention      (captured)
    attention 0   with the step's real metadata             (eager)
    piece i       layer i-1 after attention (o_proj, norm, MLP), layer i up to attention
    attention i   ...
    piece L       layer L-1 after attention, final norm     (captured)

What each piece reads and writes, all static buffers sized for the largest bucket (a bucket of
T tokens uses their first T rows)::

    token inputs   ids, positions, slots (token_inputs.py)  read by piece 0 (ids) and every
                   piece's rope + KV write (positions, slots: padding rows slot -1)
    residual       [T, hidden]            piece i writes it, piece i+1 reads it
    qkv            [T, Hq + 2 Hkv, D]     piece i writes q, k, v; attention i reads them (k, v:
                                          SDPA prefills attend over them, not the cache)
    attn_out       [T, Hq D]              attention i writes rows < n; piece i+1 reads it
    hidden         [T, hidden]            piece L writes it; the runner returns rows < n

The rope and the KV-cache write stay inside the pieces: they read per-step data, but only as
per-token tensors (positions, slots) that live at fixed addresses. Attention is the one op
that reads sequence structure (query starts, lengths, block tables) and picks its kernel and
grid from host values (``max_query_len``), so it runs eagerly over the real n tokens.

Every piece copies its results into those buffers and returns nothing, so no graph keeps any
of its own pool memory alive: all pieces of all buckets share one pool, whose size is about
one piece's working set at the largest bucket. The copies cost a few [T, hidden]-sized
writes per layer; an attention ``out=`` in the kernels would save one of them.

``GraphBackend`` as for the decode graphs: ``EagerBackend`` re-runs each piece over the same
buffers (the CPU tests), ``CudaGraphBackend`` captures them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from tandem.kernels import AttentionMetadata
from tandem.workers.graphs.runner import CaptureReport, GraphBackend, timed_capture
from tandem.workers.graphs.sizes import bucket_for
from tandem.workers.graphs.token_inputs import StaticTokenInputs

logger = logging.getLogger(__name__)


@dataclass
class PiecewiseGraphRunner:
    """Captured pieces per token bucket; ``run`` replays them around eager attention or
    returns None (go eager). ``model``: a Llama-family model (``workers/models/llama.py``)."""

    model: torch.nn.Module
    kv_cache: torch.Tensor
    block_size: int
    sizes: list[int]
    backend: GraphBackend
    # prefix-free prefills attend with SDPA over the step's own K/V (kernels/prefill_attention)
    sdpa_prefills: bool = False
    replays: dict[int, list[Callable[[], Any]]] = field(init=False, default_factory=dict)
    num_replays: dict[int, int] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.sizes = sorted(self.sizes)
        num_slots = self.kv_cache.shape[0] * self.block_size
        if num_slots >= 2**31:
            raise ValueError(f"{num_slots} KV slots do not fit the graphs' int32 slot buffer")
        body = self.model.model
        self.layers = list(body.layers)
        attn = self.layers[0].self_attn
        self.num_heads, self.num_kv_heads = attn.num_heads, attn.num_kv_heads
        embed = body.embed_tokens.weight
        t, dev, dtype = self.sizes[-1], self.kv_cache.device, embed.dtype
        self.inputs = StaticTokenInputs(t, dev)
        heads = self.num_heads + 2 * self.num_kv_heads
        self.residual = torch.zeros(t, embed.shape[1], dtype=dtype, device=dev)
        self.qkv = torch.zeros(t, heads, attn.head_dim, dtype=dtype, device=dev)
        self.attn_out = torch.zeros(t, self.num_heads * attn.head_dim, dtype=dtype, device=dev)
        self.hidden = torch.zeros(t, embed.shape[1], dtype=dtype, device=dev)

    @property
    def num_pieces(self) -> int:
        return len(self.layers) + 1

    @property
    def buffer_bytes(self) -> int:
        """Device bytes of the static buffers (outside the graphs' pool)."""
        tensors = (self.residual, self.qkv, self.attn_out, self.hidden)
        return self.inputs.num_bytes + sum(x.numel() * x.element_size() for x in tensors)

    def bucket_for(self, num_tokens: int) -> int | None:
        return bucket_for(num_tokens, self.sizes)

    @torch.inference_mode()
    def capture(self, log: bool = True) -> CaptureReport:
        """Capture every piece of every bucket, largest bucket first, over all-padding inputs
        (every slot -1: nothing is written to the KV cache)."""

        def capture_all() -> None:
            for size in reversed(self.sizes):
                self.inputs.fill([], [], None, size)
                self.replays[size] = [
                    self.backend.capture(self._piece_fn(size, i)) for i in range(self.num_pieces)
                ]
                self.num_replays[size] = 0

        device = self.kv_cache.device
        seconds, num_bytes = timed_capture(device, capture_all)
        if device.type == "cuda":
            num_bytes += self.buffer_bytes
        report = CaptureReport(list(self.sizes), seconds, num_bytes)
        if log:
            logger.info(
                "captured %d piecewise graphs (%d token sizes %s x %d pieces) in %.2f s, "
                "%.1f MiB of device memory",
                len(self.sizes) * self.num_pieces,
                len(self.sizes),
                ",".join(map(str, self.sizes)) if len(self.sizes) <= 8 else f"{self.sizes[0]}..",
                self.num_pieces,
                seconds,
                num_bytes / 2**20,
            )
        return report

    def _piece_fn(self, size: int, index: int) -> Callable[[], None]:
        body, layers, kv_cache = self.model.model, self.layers, self.kv_cache
        ids, positions, slots = self.inputs.views(size)
        residual, qkv = self.residual[:size], self.qkv[:size]
        attn_out, hidden = self.attn_out[:size], self.hidden[:size]
        q_end = self.num_heads
        k_end = q_end + self.num_kv_heads

        def piece() -> None:
            if index == 0:
                h, res = body.embed_tokens(ids), None
            else:
                h, res = layers[index - 1].after_attention(attn_out, residual)
            if index == len(layers):
                hidden.copy_(body.final_norm(h, res))
                return
            rope = body.rotary_emb.lookup(positions, hidden.dtype)
            q, k, v, res = layers[index].before_attention(h, res, rope, kv_cache, slots)
            residual.copy_(res)
            qkv[:, :q_end].copy_(q)
            qkv[:, q_end:k_end].copy_(k)
            qkv[:, k_end:].copy_(v)

        return piece

    def run(
        self,
        input_ids: list[int],
        positions: list[int],
        block_tables: list[list[int]],
        seq_lens: list[int],
        query_lens: list[int],
        patch_ids: Callable[[torch.Tensor], None] | None = None,
    ) -> torch.Tensor | None:
        """Hidden states ``[n, hidden]`` of any step of n tokens (prefills, chunks, decodes,
        flat as the runner lays them out), or None when no token bucket holds n. The result
        is a view of a static buffer: read it before the next ``run``. ``patch_ids``: as in
        ``DecodeGraphRunner.run``."""
        n = len(input_ids)
        size = self.bucket_for(n)
        if size is None or size not in self.replays:
            return None
        meta = AttentionMetadata.build(
            block_tables, seq_lens, query_lens, self.block_size, self.kv_cache.device
        )
        meta.sdpa_prefills = self.sdpa_prefills
        self.inputs.fill(input_ids, positions, meta.slot_mapping, size)
        if patch_ids is not None:
            patch_ids(self.inputs.views(n)[0])
        pieces = self.replays[size]
        q_end = self.num_heads
        k_end = q_end + self.num_kv_heads
        q, k, v = self.qkv[:n, :q_end], self.qkv[:n, q_end:k_end], self.qkv[:n, k_end:]
        for layer, piece in zip(self.layers, pieces):
            piece()
            self.attn_out[:n].copy_(layer.self_attn.attend(q, k, v, self.kv_cache, meta))
        pieces[-1]()
        self.num_replays[size] += 1
        return self.hidden[:n]
