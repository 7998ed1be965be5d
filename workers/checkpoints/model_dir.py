"""A model's HF directory, without torch in this process (the gateway imports this).

    resolve_model_dir(model) -> local HF directory   (builds / converts / downloads in a
                                                       child process when torch is barred)

``resolve_model_path`` (``workers/checkpoints/loader.py``) may build the ``tiny`` checkpoint
or convert a GGUF file, which needs torch. The gateway process bars torch
(``cluster.gateway.torch_free``), so there it runs in a child interpreter
(``python -m tandem.workers.checkpoints.resolve MODEL``) that prints the directory, or the error,
which is raised here as the same exception class with the same message. Where torch may be
imported (engines, tests, ``tandem generate``) it runs in-process. What needs no torch is
answered here in either case (``ready_model_dir``): the ``tiny`` checkpoint once built and an
existing HF directory, the common starts; the child imports torch, 2-3 s of CPU per start.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tandem.workers.checkpoints.builtin import BUILTIN_MODELS
from tandem.workers.checkpoints.cache_dir import built_tiny_dir

# exception classes a failed resolution may raise (the child names one of them)
_ERRORS = {"ValueError": ValueError, "FileNotFoundError": FileNotFoundError}


def torch_barred() -> bool:
    """True in a process that barred ``import torch`` (``sys.modules["torch"] is None``)."""
    return "torch" in sys.modules and sys.modules["torch"] is None


def resolve_model_dir(model: str, *, timeout_s: float = 1800.0) -> str:
    """The local HF directory of ``model`` (see ``loader.resolve_model_path``): in-process
    when torch may be imported, else in a child interpreter. A GGUF conversion or a hub
    download can take minutes on first use, hence the long deadline."""
    ready = ready_model_dir(model)
    if ready is not None:
        return ready
    if not torch_barred():
        from tandem.workers.checkpoints.loader import resolve_model_path

        return resolve_model_path(model)
    done = subprocess.run(
        [sys.executable, "-m", "tandem.workers.checkpoints.resolve", model],
        capture_output=True,
        text=True,
        timeout=timeout_s,
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


def ready_model_dir(model: str) -> str | None:
    """What ``resolve_model_path`` answers for ``model`` when that needs no torch and builds,
    converts or fetches nothing: the ``tiny`` checkpoint once built, or a directory with a
    ``config.json`` (as is). None for anything else (a first build, a GGUF file or name, a
    hub id, a missing path: ``resolve_model_path`` decides, and raises its errors)."""
    if model == "tiny":
        return built_tiny_dir()
    if model in BUILTIN_MODELS:  # a name before a directory of that name
        return None
    expanded = os.path.expanduser(model)
    if os.path.isfile(os.path.join(expanded, "config.json")):
        return os.path.abspath(expanded)
    return None
