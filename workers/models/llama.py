"""Llama-family causal LMs on a paged KV cache: Llama 2/3, Mistral (base here),
Qwen2/Qwen3 (``qwen.py``).

Contract shared by every model class::

    model = cls(hf_config, dtype)                 # parameters uninitialised
    model.load_weights(iter of (hf_name, tensor)) # every weight, HF names
    hidden = model(input_ids [T] long, positions [T] long, kv_cache, meta)  # [T, hidden]
    logits = model.compute_logits(hidden[idx])    # [N, vocab] float32

The batch is flat: T tokens from all sequences back to back, described by
``kernels.AttentionMetadata`` (slot mapping, block tables, lengths), or a
``workers.runner.attention.SplitAttention`` when the runner sends decodes through
the dense CPU fast path.
``kv_cache`` is the whole engine cache, blocks-first
``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``; layer
``i`` reads and writes ``kv_cache[:, i]``. Run it under ``torch.inference_mode()``.
Padding tokens (slot -1) still need a valid position (< ``max_context_len``).
Attributes for the runner: ``num_layers``, ``num_kv_heads``, ``head_dim``,
``vocab_size``, ``dtype``, ``max_context_len`` (max_position_embeddings,
capped by a sliding window, which we attend in full).

The forward is cut into pieces at attention, which piecewise CUDA graphs
(``workers/graphs/piecewise.py``) capture separately::

    embed | layer.before_attention | self_attn.attend | layer.after_attention | ... | final_norm
            (norm, qkv, rope, KV write)   (eager: reads       (o_proj, norm, MLP)
                                           lengths, tables)

Parameter names follow HF except the fused ``qkv_proj`` (q, k, v rows) and
``mlp.gate_up_proj`` (gate, up rows); ``load_weights`` maps HF names onto
them and raises on missing, unexpected or mis-shaped weights.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from tandem.workers.compile.attention_op import attend, rope_write_kv
from tandem.workers.models.layers import Embedding, Linear, RMSNorm, SiluMLP, lm_head_logits
from tandem.workers.models.rope import RotaryEmbedding
from tandem.workers.runner.attention import StepMetadata

# Checkpoint entries that are not weights (old HF checkpoints saved them).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class LlamaAttention(nn.Module):
    def __init__(self, config: Any, layer_idx: int, dtype: torch.dtype, arch: type) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = head_dim_of(config)
        self.scale = self.head_dim**-0.5
        hidden = config.hidden_size
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(
            hidden,
            [q_size, kv_size, kv_size],
            arch.qkv_bias(config),
            dtype,
            shard_names=["q_proj", "k_proj", "v_proj"],
        )
        self.o_proj = Linear(q_size, [hidden], arch.o_bias(config), dtype)
        if arch.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype)
        else:
            self.q_norm = self.k_norm = None

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,
        meta: StepMetadata,
    ) -> torch.Tensor:
        q, k, v = self.project(x, rope, kv_cache, meta.slot_mapping)
        return self.o_proj(self.attend(q, k, v, kv_cache, meta))

    def project(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v ``[T, heads, head_dim]`` of ``x`` (q, k rotated); writes k, v to this
        layer's cache at ``slot_mapping`` (-1 skips). Reads no other step metadata, so a
        piecewise CUDA graph captures it over static positions and slots."""
        num_tokens = x.shape[0]
        num_heads, num_kv_heads = self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(x).view(num_tokens, num_heads + 2 * num_kv_heads, self.head_dim)
        if self.q_norm is None:
            qk = qkv[:, : num_heads + num_kv_heads]
        else:
            q = self.q_norm(qkv[:, :num_heads])
            k = self.k_norm(qkv[:, num_heads : num_heads + num_kv_heads])
            qk = torch.cat((q, k), dim=1)
        v = qkv[:, num_heads + num_kv_heads :]
        # q and k rotate together, and the rotated k and v go straight to the cache: one
        # Triton launch on CUDA, the rope ops plus the cache write on CPU (under
        # torch.compile the write moves into the attention op: workers/compile/).
        qk = rope_write_kv(self.layer_idx, qk, v, rope, kv_cache, slot_mapping)
        return qk[:, :num_heads], qk[:, num_heads:], v

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: StepMetadata,
    ) -> torch.Tensor:
        """Attention over the cache (which already holds this step's k, v): ``[T, heads *
        head_dim]``. The one part of a layer that reads the step's lengths and block tables."""
        out = attend(self.layer_idx, q, k, v, kv_cache, meta, self.scale)
        return out.reshape(q.shape[0], -1)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: Any, layer_idx: int, dtype: torch.dtype, arch: type) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps, dtype)
        self.self_attn = LlamaAttention(config, layer_idx, dtype, arch)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, dtype)
        self.mlp = SiluMLP(
            config.hidden_size, config.intermediate_size, arch.mlp_bias(config), dtype
        )

    def forward(
        self,
        h: torch.Tensor,
        residual: torch.Tensor | None,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,
        meta: StepMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mlp output, residual stream before it)``; the next layer (or the final norm)
        adds the two in its fused add+norm. ``residual`` None: ``h`` is the embedding."""
        attn = self.self_attn
        q, k, v, residual = self.before_attention(h, residual, rope, kv_cache, meta.slot_mapping)
        return self.after_attention(attn.attend(q, k, v, kv_cache, meta), residual)

    def before_attention(
        self,
        h: torch.Tensor,
        residual: torch.Tensor | None,
        rope: tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Input norm (adding the previous layer's output), q, k, v and the KV write:
        ``(q, k, v, residual)``. The piece of the layer before attention."""
        if residual is None:
            x, residual = self.input_layernorm(h), h
        else:
            x, residual = self.input_layernorm.add(h, residual)
        return (*self.self_attn.project(x, rope, kv_cache, slot_mapping), residual)

    def after_attention(
        self, attn_out: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """o_proj, post-attention norm and MLP: ``(mlp output, residual)``."""
        x, residual = self.post_attention_layernorm.add(self.self_attn.o_proj(attn_out), residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype, arch: type) -> None:
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, dtype)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, dtype, arch) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.rotary_emb = RotaryEmbedding(
            head_dim_of(config), config.max_position_embeddings, config
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: StepMetadata,
    ) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        rope = self.rotary_emb.lookup(positions, h.dtype)
        residual = None
        for layer in self.layers:
            h, residual = layer(h, residual, rope, kv_cache, meta)
        return self.final_norm(h, residual)

    def final_norm(self, h: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        return self.norm(h) if residual is None else self.norm.add(h, residual)[0]


class LlamaForCausalLM(nn.Module):
    """Llama 2/3 (``rope_type`` default, linear or llama3; optional biases)."""

    qk_norm = False  # Qwen3 normalises q and k per head

    @staticmethod
    def qkv_bias(config: Any) -> bool:
        return bool(getattr(config, "attention_bias", False))

    @staticmethod
    def o_bias(config: Any) -> bool:
        return bool(getattr(config, "attention_bias", False))

    @staticmethod
    def mlp_bias(config: Any) -> bool:
        return bool(getattr(config, "mlp_bias", False))

    def __init__(self, config: Any, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"{type(self).__name__}: hidden_act {act!r} unsupported (silu only)")
        self.config = config
        self.dtype = dtype
        self.num_layers = config.num_hidden_layers
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or (
            config.num_attention_heads
        )
        self.head_dim = head_dim_of(config)
        self.vocab_size = config.vocab_size
        self.max_context_len = self._max_context_len(config)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.model = LlamaModel(config, dtype, type(self))
        # tensor parallel (workers/parallel/layers.py): this rank's vocab rows -> all
        self.logits_gather: Any = None
        if self.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = Linear(
                config.hidden_size, [config.vocab_size], False, dtype, transposed=False
            )

    def _max_context_len(self, config: Any) -> int:
        """Longest sequence (prompt + output) this model computes exactly.

        We always attend to the full context, which equals sliding-window
        attention while a sequence is no longer than the window, so a
        sliding window (Mistral v0.1, Qwen with ``use_sliding_window``) caps it.
        """
        window = effective_sliding_window(config)
        limit = int(config.max_position_embeddings)
        return limit if window is None else min(limit, int(window))

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: StepMetadata,
    ) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` after the final norm; writes this step's KV."""
        return self.model(input_ids, positions, kv_cache, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, hidden] -> [N, vocab]`` float32 logits (matmul in the model dtype)."""
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = lm_head_logits(hidden, weight)
        if self.logits_gather is not None:
            logits = self.logits_gather(logits)
        return logits.float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into the parameters (casting dtype/device).

        Every parameter must be covered exactly; raises ``ValueError`` naming
        missing weights, unexpected names or shape mismatches. With tied
        embeddings a checkpoint's ``lm_head.weight`` is ignored.
        """
        slots = self.hf_weight_slots()
        loaded: set[str] = set()
        unexpected: list[str] = []
        for name, tensor in weights:
            if name.endswith(_IGNORED_SUFFIXES) or (
                self.tie_word_embeddings and name == "lm_head.weight"
            ):
                continue
            slot = slots.get(name)
            if slot is None:
                unexpected.append(name)
                continue
            if tuple(slot.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"weight {name!r}: expected shape {tuple(slot.shape)}, "
                    f"checkpoint has {tuple(tensor.shape)}"
                )
            slot.copy_(tensor)
            loaded.add(name)
        if unexpected:
            raise ValueError(
                f"{len(unexpected)} unexpected weight(s) for {type(self).__name__}: "
                f"{_preview(unexpected)}"
            )
        missing = sorted(set(slots) - loaded)
        if missing:
            raise ValueError(f"{len(missing)} missing weight(s): {_preview(missing)}")

    @torch.no_grad()
    def hf_weight_slots(self) -> dict[str, torch.Tensor]:
        """HF weight name -> the tensor view it is copied into."""
        slots: dict[str, torch.Tensor] = {}
        for module_name, module in self.named_modules():
            prefix = module_name.rpartition(".")[0]
            for param_name, param in module.named_parameters(recurse=False):
                shards = getattr(module, "shard_names", None)
                if not shards:
                    slots[f"{module_name}.{param_name}"] = param.data
                    continue
                offset = 0
                for shard, size in zip(shards, module.out_sizes, strict=True):
                    name = f"{prefix}.{shard}.{param_name}" if prefix else f"{shard}.{param_name}"
                    slots[name] = param.data.narrow(0, offset, size)
                    offset += size
        return slots


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral: Llama without biases. A ``sliding_window`` caps
    ``max_context_len`` (the loader rejects a longer ``max_model_len``)."""


def head_dim_of(config: Any) -> int:
    """Explicit ``head_dim`` if the config has one, else hidden / heads."""
    head_dim = getattr(config, "head_dim", None)
    return int(head_dim) if head_dim else config.hidden_size // config.num_attention_heads


def effective_sliding_window(config: Any) -> int | None:
    """The sliding window some layer uses, or None when all attention is full."""
    window = getattr(config, "sliding_window", None)
    if window is None:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return window if "sliding_attention" in layer_types else None
    if hasattr(config, "use_sliding_window"):
        return window if config.use_sliding_window else None
    return window


def _preview(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")
