"""Model registry: HF ``architectures`` name -> our model class."""

from __future__ import annotations

from torch import nn

from workers.models.llama import LlamaForCausalLM, MistralForCausalLM
from workers.models.qwen import Qwen2ForCausalLM, Qwen3ForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}


def get_model_class(architectures: list[str] | None) -> type[nn.Module]:
    """First supported class among a config's ``architectures``.

    Raises ``ValueError`` naming the architectures and the supported list.
    """
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
    "Qwen3ForCausalLM",
    "get_model_class",
]
