"""A model's HF directory and its config, without torch (the gateway process imports this).

    resolve_model_dir(model) -> local HF directory   (builds / converts / downloads in a
                                                       child process when torch is barred)
    load_config(path)        -> transformers config, generation_config's end ids merged

``resolve_model_path`` (``workers/checkpoints/loader.py``) may build the ``tiny`` checkpoint
or convert a GGUF file, which needs torch. The gateway process bars torch
(``cluster.gateway.torch_free``), so there it runs in a child interpreter
(``python -m workers.checkpoints.resolve MODEL``) that prints the directory, or the error,
which is raised here as the same exception class with the same message. Where torch may be
imported (engines, tests, ``tandem generate``) it runs in-process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

# exception classes a failed resolution may raise (the child names one of them)
_ERRORS = {"ValueError": ValueError, "FileNotFoundError": FileNotFoundError}


def torch_barred() -> bool:
    """True in a process that barred ``import torch`` (``sys.modules["torch"] is None``)."""
    return "torch" in sys.modules and sys.modules["torch"] is None


def resolve_model_dir(model: str, *, timeout_s: float = 1800.0) -> str:
    """The local HF directory of ``model`` (see ``loader.resolve_model_path``): in-process
    when torch may be imported, else in a child interpreter. A GGUF conversion or a hub
    download can take minutes on first use, hence the long deadline."""
    if not torch_barred():
        from workers.checkpoints.loader import resolve_model_path

        return resolve_model_path(model)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    done = subprocess.run(
        [sys.executable, "-m", "workers.checkpoints.resolve", model],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=env,
    )
    lines = done.stdout.strip().splitlines()
    try:
        answer = json.loads(lines[-1]) if lines else {}
    except json.JSONDecodeError:
        answer = {}
    if done.returncode == 0 and "path" in answer:
        return answer["path"]
    if "error" in answer:
        raise _ERRORS.get(answer.get("type"), ValueError)(answer["error"])
    raise ValueError(
        f"model {model!r}: resolving it in a child process failed (exit {done.returncode}): "
        + (done.stderr.strip().splitlines() or ["no output"])[-1]
    )


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
