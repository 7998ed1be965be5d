"""Rotary position embedding (rotate-half layout, as HF Llama/Mistral/Qwen).

cos/sin tables are computed once for every position up to
``max_position_embeddings`` (float32, ``[max_pos, head_dim / 2]``) and
indexed by the flat ``positions`` tensor at each step.

Supported ``rope_type``: ``default``, ``linear`` and ``llama3``. Others
(``dynamic``, ``yarn``, ...) raise ``ValueError``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from tandem.kernels import fused_reference

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_settings(config: Any) -> tuple[float, dict[str, Any]]:
    """Return ``(rope_theta, scaling)`` from a HF config, old or new style.

    transformers >= 5 stores everything in ``config.rope_parameters``; older
    versions use ``config.rope_theta`` and ``config.rope_scaling``.
    ``scaling`` always has a ``rope_type`` key.
    """
    params = getattr(config, "rope_parameters", None)
    legacy = getattr(config, "rope_scaling", None)
    theta = getattr(config, "rope_theta", None)
    scaling: dict[str, Any] = dict(params or legacy or {})
    theta = scaling.pop("rope_theta", theta)
    if theta is None:
        theta = 10000.0
    rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    scaling["rope_type"] = rope_type
    return float(theta), scaling


def inverse_frequencies(head_dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    """``[head_dim / 2]`` float32 inverse frequencies after rope scaling."""
    rope_type = scaling["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported rope_type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if rope_type == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif rope_type == "llama3":
        inv_freq = _llama3_scale(inv_freq, scaling)
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    # Long wavelengths are divided by `factor`, short ones kept, the band in
    # between interpolated smoothly (Llama 3.1 recipe).
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling["low_freq_factor"])
    high_freq_factor = float(scaling["high_freq_factor"])
    old_context_len = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin tables; ``lookup`` once per step, ``apply`` in every layer."""

    def __init__(self, head_dim: int, max_position: int, config: Any) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"rope needs an even head_dim, got {head_dim}")
        theta, scaling = rope_settings(config)
        inv_freq = inverse_frequencies(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.int64).float(), inv_freq)
        self.max_position = max_position
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def lookup(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[T, 1, head_dim / 2]`` in ``dtype`` for ``positions [T]``."""
        cos = self.cos.index_select(0, positions).to(dtype).unsqueeze(1)
        sin = self.sin.index_select(0, positions).to(dtype).unsqueeze(1)
        return cos, sin

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate ``x [T, heads, head_dim]`` (any strides); returns a new tensor.

        Same roundings as HF's ``x * cos + rotate_half(x) * sin`` with cos/sin
        duplicated over both halves, at half the table size. The model itself rotates
        through ``kernels.dispatch.rope_write_kv`` (fused with the KV write on CUDA).
        """
        return fused_reference.rope(x, cos, sin)
