"""Model registry: HF ``architectures`` name -> our model class.

A config without ``architectures`` (GGUF metadata, hand-written configs)
resolves by ``model_type``, as transformers and vLLM do.
"""

from __future__ import annotations

from torch import nn

from tandem.workers.models.llama import LlamaForCausalLM, MistralForCausalLM
from tandem.workers.models.qwen import Qwen2ForCausalLM, Qwen3ForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}
# HF model_type -> architecture name, for configs without ``architectures``.
MODEL_TYPES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


def architecture_for_model_type(model_type: str | None) -> str:
    """Architecture name for ``model_type``; ``ValueError`` naming the supported types."""
    if model_type not in MODEL_TYPES:
        raise ValueError(
            f"unsupported model_type {model_type!r}; supported: {', '.join(sorted(MODEL_TYPES))}"
        )
    return MODEL_TYPES[model_type]


def get_model_class(
    architectures: list[str] | None, model_type: str | None = None
) -> type[nn.Module]:
    """First supported class among a config's ``architectures``; without any, by ``model_type``.

    Raises ``ValueError`` naming the architectures and the supported list.
    """
    if not architectures and model_type is not None:
        return MODEL_REGISTRY[architecture_for_model_type(model_type)]
    for name in architectures or []:
        if name in MODEL_REGISTRY:
            return MODEL_REGISTRY[name]
    raise ValueError(
        f"unsupported model architecture {architectures!r}; "
        f"supported: {', '.join(sorted(MODEL_REGISTRY))}"
    )


__all__ = [
    "MODEL_REGISTRY",
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "MODEL_TYPES",
    "Qwen3ForCausalLM",
    "architecture_for_model_type",
    "get_model_class",
]
