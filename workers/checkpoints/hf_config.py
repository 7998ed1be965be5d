"""A model directory's config without torch: ``load_config(path)`` -> the transformers config
with ``generation_config.json``'s end ids merged (the engine stops on every id either file
names: chat models end a turn with a token that is not always the config's eos). The loader,
the tensor-parallel checks and the gateway's placement checks read configs through it."""

from __future__ import annotations

import json
import os
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


def end_token_ids(config: Any) -> list[int]:
    """The config's end ids as a list (``load_config`` merged generation_config's)."""
    return as_id_list(getattr(config, "eos_token_id", None))


def as_id_list(ids: Any) -> list[int]:
    if ids is None:
        return []
    return [int(i) for i in ids] if isinstance(ids, (list, tuple)) else [int(ids)]
