"""Tiny random HF checkpoints built with transformers, for oracle tests.

    path = make_checkpoint("qwen3", tmp_dir, num_hidden_layers=1)
    hf = load_hf_model(path)            # transformers' model = the oracle

``arch`` is a preset name (``ARCH_PRESETS``) or an HF class name such as
``"LlamaForCausalLM"``; ``overrides`` are config fields. Weights are
re-drawn from a seeded generator (std 0.1, norm weights 1 +- 0.1, biases
included) so every parameter matters; saved as fp32 safetensors, sharded
when ``max_shard_size`` is given.
"""

from __future__ import annotations

import os
from typing import Any

import torch

_SMALL: dict[str, Any] = {
    "vocab_size": 300,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}

# preset -> (HF architecture, config overrides on top of _SMALL)
ARCH_PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaForCausalLM", {}),
    "llama3": (
        "LlamaForCausalLM",
        {
            "rope_theta": 500000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 128,
            },
        },
    ),
    "llama_head_dim48": ("LlamaForCausalLM", {"head_dim": 48}),
    "mistral": ("MistralForCausalLM", {"sliding_window": None}),
    "qwen2": ("Qwen2ForCausalLM", {}),
    "qwen2_tied": ("Qwen2ForCausalLM", {"tie_word_embeddings": True}),
    "qwen3": ("Qwen3ForCausalLM", {"head_dim": 32}),
    "qwen3_bias": ("Qwen3ForCausalLM", {"head_dim": 24, "attention_bias": True}),
}


def make_config(arch: str, **overrides: Any) -> Any:
    """HF config for a preset or class name, small defaults plus ``overrides``."""
    import transformers

    class_name, preset = ARCH_PRESETS.get(arch, (arch, {}))
    model_type = {
        "LlamaForCausalLM": "llama",
        "MistralForCausalLM": "mistral",
        "Qwen2ForCausalLM": "qwen2",
        "Qwen3ForCausalLM": "qwen3",
    }[class_name]
    config_cls = transformers.AutoConfig.for_model(model_type).__class__
    kwargs = {**_SMALL, **preset, **overrides}
    return config_cls(**kwargs, architectures=[class_name], dtype="float32")


def make_checkpoint(
    arch: str,
    out_dir: str | os.PathLike,
    *,
    seed: int = 0,
    max_shard_size: str | int | None = None,
    **overrides: Any,
) -> str:
    """Write a random checkpoint of ``arch`` into ``out_dir``; returns the path."""
    import transformers

    config = make_config(arch, **overrides)
    model_cls = getattr(transformers, config.architectures[0])
    model = model_cls(config).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=generator) * 0.1
            param.copy_(1.0 + noise if name.endswith("norm.weight") else noise)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(str(out_dir), **kwargs)
    return str(out_dir)


def load_hf_model(path: str) -> Any:
    """transformers' fp32 eager model from ``path``, in eval mode."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()


def hf_logits(hf_model: Any, token_ids: list[int]) -> torch.Tensor:
    """``[len(token_ids), vocab]`` fp32 logits of one full-sequence forward."""
    with torch.inference_mode():
        out = hf_model(torch.tensor([token_ids]), use_cache=False)
    return out.logits[0].float()
