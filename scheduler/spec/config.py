"""``--speculative-config``: vLLM's JSON shape, validated into a typed value.

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
     "prompt_lookup_max": 5}
    {"method": "draft_model", "model": "smollm2", "num_speculative_tokens": 4}

Errors name the field (``speculative_config.num_speculative_tokens``). ``model`` names
the draft as ``--model`` names the target (``tiny``, ``smollm2``, a local directory or
GGUF file); the engine checks at start that it shares the target's vocabulary
(``workers/spec/draft_model.py``). EAGLE and MTP are recognised and refused by name:
they plug into the same seam as the draft model (``scheduler/spec/proposer.py``) but are
not built yet.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

METHODS = ("ngram", "draft_model")
# vLLM's names of the proposers Tandem does not have yet: refused with a clear error
PLANNED_METHODS = ("eagle", "eagle3", "mtp", "medusa")
MAX_SPECULATIVE_TOKENS = 16
_FIELDS = (
    "method",
    "num_speculative_tokens",
    "prompt_lookup_min",
    "prompt_lookup_max",
    "disable_by_batch_size",
    "model",
)
_PREFIX = "speculative_config"


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 4
    # n-gram proposer: the longest / shortest suffix looked up in the earlier tokens
    prompt_lookup_min: int = 5
    prompt_lookup_max: int = 5
    # vLLM's knob: no drafts in a step that starts with at least this many running
    # requests (None: always draft). Where a step is compute-bound, drafts cost more
    # than they save (docs/benchmarks.md: CPU, batch 32).
    disable_by_batch_size: int | None = None
    # draft model: its name or path, resolved as --model is
    model: str | None = None

    @property
    def uses_draft_model(self) -> bool:
        return self.method == "draft_model"

    @classmethod
    def from_dict(cls, value: Any) -> SpeculativeConfig | None:
        """``value`` (a mapping, JSON text, or None/{} = no speculation) as a config;
        ``ValueError`` naming the bad field."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            import json

            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{_PREFIX}: not valid JSON ({exc.msg})") from None
        if not isinstance(value, dict):
            raise ValueError(f"{_PREFIX} must be a JSON object, got {value!r}")
        if not value:
            return None
        unknown = sorted(set(value) - set(_FIELDS))
        if unknown:
            raise ValueError(
                f"{_PREFIX}.{unknown[0]} is not a setting (known: {', '.join(_FIELDS)})"
            )
        method = value.get("method")
        if method is None:
            raise ValueError(f"{_PREFIX}.method is required (one of: {', '.join(METHODS)})")
        if method in PLANNED_METHODS:
            raise ValueError(
                f"{_PREFIX}.method {method!r} is not supported yet (supported: "
                f"{', '.join(METHODS)})"
            )
        if method not in METHODS:
            raise ValueError(
                f"{_PREFIX}.method must be one of {', '.join(METHODS)}, got {method!r}"
            )
        model = value.get("model")
        if method == "draft_model":
            if not isinstance(model, str) or not model:
                raise ValueError(
                    f"{_PREFIX}.model is required for method 'draft_model' (a model name "
                    f"or path, as --model), got {model!r}"
                )
            for name in ("prompt_lookup_min", "prompt_lookup_max"):
                if name in value:
                    raise ValueError(f"{_PREFIX}.{name} applies to method 'ngram' only")
        elif "model" in value:
            raise ValueError(f"{_PREFIX}.model applies to method 'draft_model' only")
        k = _int(value, "num_speculative_tokens", None)
        if k is None:
            raise ValueError(f"{_PREFIX}.num_speculative_tokens is required")
        if not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"{_PREFIX}.num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}], "
                f"got {k}"
            )
        lo = _int(value, "prompt_lookup_min", None)
        hi = _int(value, "prompt_lookup_max", None)
        # as vLLM: one given sets both; neither: 5 and 5
        if lo is None and hi is None:
            lo, hi = 5, 5
        elif lo is None:
            lo = hi
        elif hi is None:
            hi = lo
        if lo < 1:
            raise ValueError(f"{_PREFIX}.prompt_lookup_min must be >= 1, got {lo}")
        if hi < lo:
            raise ValueError(
                f"{_PREFIX}.prompt_lookup_max ({hi}) must be >= prompt_lookup_min ({lo})"
            )
        off = _int(value, "disable_by_batch_size", None)
        if off is not None and off < 1:
            raise ValueError(f"{_PREFIX}.disable_by_batch_size must be >= 1, got {off}")
        return cls(method, k, lo, hi, off, model if method == "draft_model" else None)

    def to_dict(self) -> dict[str, Any]:
        if self.uses_draft_model:
            shape: dict[str, Any] = {"model": self.model}
        else:
            shape = {
                "prompt_lookup_min": self.prompt_lookup_min,
                "prompt_lookup_max": self.prompt_lookup_max,
            }
        return {
            "method": self.method,
            "num_speculative_tokens": self.num_speculative_tokens,
            **shape,
            **(
                {"disable_by_batch_size": self.disable_by_batch_size}
                if self.disable_by_batch_size is not None
                else {}
            ),
        }


def _int(value: dict, name: str, default: int | None) -> int | None:
    v = value.get(name, default)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"{_PREFIX}.{name} must be an integer, got {v!r}")
    return v
