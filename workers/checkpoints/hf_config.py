"""A model directory's config without torch: ``load_config(path)`` -> the transformers config
with ``generation_config.json``'s end ids merged (the engine stops on every id either file
names: chat models end a turn with a token that is not always the config's eos). The loader,
the tensor-parallel checks and the gateway's placement checks read configs through it."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace
from typing import Any


def load_config(path: str) -> Any:
    """``transformers.AutoConfig`` for a model directory, end ids merged.

    ``eos_token_id`` becomes the config's end ids followed by any other ones
    ``generation_config.json`` names (an int when there is one).
    """
    from transformers import AutoConfig

    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"no config.json in model directory {path!r}")
    config = AutoConfig.from_pretrained(path)
    end_ids = as_id_list(getattr(config, "eos_token_id", None))
    gen_file = os.path.join(path, "generation_config.json")
    if os.path.isfile(gen_file):
        with open(gen_file) as f:
            gen_ids = as_id_list(json.load(f).get("eos_token_id"))
        end_ids += [i for i in gen_ids if i not in end_ids]
    if end_ids:
        config.eos_token_id = end_ids[0] if len(end_ids) == 1 else end_ids
    return config


def plain_config(path: str) -> dict[str, Any]:
    """``load_config(path)`` as plain attributes (its ``to_dict()``, end ids merged): what the
    gateway hands each engine (``model_config``), as vLLM's front end hands its engine core the
    model config. The engine then builds the model from ``config_namespace`` of it and never
    imports transformers' configuration classes, which pull torch._dynamo and
    torch.distributed.tensor where torch is installed: 2-3 CPU-seconds per engine start."""
    return load_config(path).to_dict()


def config_namespace(attrs: dict[str, Any]) -> SimpleNamespace:
    """A read-only view of ``plain_config``'s dict with the config's attribute names (the model
    code reads configs with ``getattr``; tensor-parallel workers get the same view)."""
    return SimpleNamespace(**attrs)


def end_token_ids(config: Any) -> list[int]:
    """The config's end ids as a list (``load_config`` merged generation_config's)."""
    return as_id_list(getattr(config, "eos_token_id", None))


def as_id_list(ids: Any) -> list[int]:
    if ids is None:
        return []
    return [int(i) for i in ids] if isinstance(ids, (list, tuple)) else [int(ids)]
