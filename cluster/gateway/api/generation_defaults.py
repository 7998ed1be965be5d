"""Sampling defaults from a checkpoint's ``generation_config.json`` (vLLM's ``--generation-config``).

    --generation-config auto   (default) read <model dir>/generation_config.json
    --generation-config vllm   ignore it: a field the request omits gets Tandem's default
    --generation-config DIR    read DIR/generation_config.json

Only the keys vLLM reads are used: ``temperature``, ``top_p``, ``top_k``,
``min_p``, ``repetition_penalty`` and ``max_new_tokens`` (the default
``max_tokens``); ``do_sample`` and the rest are ignored, as in vLLM. A default
applies only when the request leaves the field out (or sends null), and only
for fields the sampler supports (``SamplingParams``' fields): an unsupported
one is logged once at start and dropped.
"""

from __future__ import annotations

import json
import logging
import math
import os
from typing import Any

import msgspec

from tandem.wire.engine_protocol import SamplingParams

logger = logging.getLogger(__name__)

# generation_config.json key -> request field
_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


class GenerationDefaults(msgspec.Struct, frozen=True):
    """Request-field defaults: ``{field: value}``, only fields the sampler supports."""

    values: dict[str, Any] = {}
    source: str = "none"  # the file they came from, for logs and /v1/models

    def apply(self, req: Any, num_free_tokens: int) -> None:
        """Fill every field of ``req`` that is None with its default (in place),
        after validation and tokenization. The default ``max_tokens`` is cut to
        ``num_free_tokens`` (context left after the prompt), as vLLM does; a chat
        request with ``max_completion_tokens`` keeps it."""
        for name, value in self.values.items():
            if name == "max_tokens":
                if getattr(req, "max_completion_tokens", None) is None and req.max_tokens is None:
                    req.max_tokens = max(1, min(value, num_free_tokens))
            elif getattr(req, name, 0) is None:
                setattr(req, name, value)


def load_generation_defaults(mode: str, model_path: str | None) -> GenerationDefaults:
    """``mode``: ``auto``, ``vllm`` or a directory. ValueError names
    ``--generation-config`` for a bad mode, directory, file or value."""
    if mode == "vllm":
        return GenerationDefaults()
    if mode == "auto":
        if model_path is None:
            return GenerationDefaults()
        folder = model_path
    else:
        folder = os.path.expanduser(mode)
        if not os.path.isdir(folder):
            raise ValueError(f"--generation-config: {mode!r} is not 'auto', 'vllm' or a directory")
    path = os.path.join(folder, "generation_config.json")
    if not os.path.isfile(path):
        if mode != "auto":
            raise ValueError(f"--generation-config: {path} does not exist")
        return GenerationDefaults()
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"--generation-config: cannot read {path}: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError(f"--generation-config: {path} is not a JSON object")
    supported = set(SamplingParams.__struct_fields__)
    values: dict[str, Any] = {}
    for key, field in _KEYS.items():
        if config.get(key) is None:
            continue
        value = _check(key, config[key], path)
        if field not in supported:
            logger.warning("%s: %s=%r ignored (the sampler has no %s)", path, key, value, field)
            continue
        values[field] = value
    if values:
        logger.info("sampling defaults from %s: %s", path, values)
    return GenerationDefaults(values, path)


def _check(key: str, value: Any, path: str) -> Any:
    where = f"--generation-config: {path}: {key}"
    if key in ("top_k", "max_new_tokens"):
        if type(value) is not int:
            raise ValueError(f"{where} must be an integer, got {value!r}")
        low = -1 if key == "top_k" else 1
        if value < low:
            raise ValueError(f"{where} must be >= {low}, got {value}")
        return value
    if type(value) not in (int, float) or not math.isfinite(value):
        raise ValueError(f"{where} must be a finite number, got {value!r}")
    value = float(value)
    if key == "top_p" and not 0.0 < value <= 1.0:
        raise ValueError(f"{where} must be in (0, 1], got {value}")
    if key == "min_p" and not 0.0 <= value <= 1.0:
        raise ValueError(f"{where} must be in [0, 1], got {value}")
    if key == "temperature" and value < 0:
        raise ValueError(f"{where} must be >= 0, got {value}")
    if key == "repetition_penalty" and value <= 0:
        raise ValueError(f"{where} must be > 0, got {value}")
    return value
