"""Qwen2 and Qwen3: Llama layers with Qwen's bias and q/k-norm choices.

Sliding-window layers (``use_sliding_window``) are attended in full, which
is exact up to the window, so ``max_context_len`` is capped at it.
"""

from __future__ import annotations

from typing import Any

from tandem.workers.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2 / Qwen2.5: q, k, v projections have a bias, o does not."""

    @staticmethod
    def qkv_bias(config: Any) -> bool:
        return True

    @staticmethod
    def o_bias(config: Any) -> bool:
        return False

    @staticmethod
    def mlp_bias(config: Any) -> bool:
        return False


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3: per-head RMSNorm on q and k before rope; ``attention_bias`` on q, k, v, o."""

    qk_norm = True
