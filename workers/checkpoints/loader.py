"""Find a model (a built-in name, a GGUF file, a local directory or a hub id) and load it.

    resolve_model_path("tiny" | "smollm2" | "x.gguf" | "/path/to/dir" | "org/name")
        -> local HF directory
    load_model(model, dtype="auto", device="cpu") -> (model, hf_config)

A model directory holds ``config.json`` and ``*.safetensors`` (one file, or
shards listed in ``model.safetensors.index.json``), plus tokenizer files. A
GGUF file (named directly, in a directory without ``config.json``, or shipped
by a built-in model's package) is converted once into such a directory in
the cache (``workers/checkpoints/gguf_convert.py``).

End ids: ``load_config`` merges ``generation_config.json``'s ``eos_token_id``
into the config's, so the engine stops on every id either file names (chat
models end a turn with a token that is not always the config's eos).

dtype "auto" takes the config's ``dtype`` / ``torch_dtype`` (float32 when
absent), except that float16 becomes float32 on CPU: CPU fp16 matmuls are
emulated and many times slower than fp32, and fp32 keeps greedy output equal
to transformers' fp32 reference. bfloat16 stays bfloat16 (halves memory and
CPUs with AVX512-BF16/AMX run it natively).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tandem.workers.checkpoints.hf_config import load_config
from tandem.workers.models import get_model_class

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16"}
_INDEX_FILE = "model.safetensors.index.json"
# Files a snapshot download needs; skips .bin/.pth duplicates and originals/.
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]


def resolve_model_path(model: str, *, cache_dir: str | None = None) -> str:
    """Local HF directory holding ``model``.

    ``"tiny"`` builds the built-in checkpoint on first use; a built-in GGUF
    name (``"smollm2"``), a ``.gguf`` file or a directory holding exactly one
    GGUF file and no ``config.json`` is converted into the cache on first use;
    an existing directory is returned as is; anything else is a hub id fetched with
    ``huggingface_hub.snapshot_download`` (the local HF cache is tried first,
    ``cache_dir`` overrides the HF cache location). A string that looks like
    a path (starts with ``/``, ``.`` or ``~``) but is not a directory raises
    ``FileNotFoundError``; an unknown or unreachable hub id raises ``ValueError``,
    as do unreadable GGUF files and missing built-in packages (one line naming
    the file or package and the cause).
    """
    from tandem.workers.checkpoints.builtin import BUILTIN_MODELS, builtin_gguf_path
    from tandem.workers.checkpoints.gguf_convert import ensure_converted

    if model == "tiny":
        from tandem.workers.checkpoints.tiny import ensure_tiny_model

        return ensure_tiny_model()
    if model in BUILTIN_MODELS:
        return ensure_converted(builtin_gguf_path(model))
    expanded = os.path.expanduser(model)
    if os.path.isfile(expanded):
        return ensure_converted(expanded)
    if os.path.isdir(expanded):
        gguf = _lone_gguf(expanded)
        return ensure_converted(gguf) if gguf else os.path.abspath(expanded)
    if model.endswith(".gguf"):
        raise FileNotFoundError(f"{model}: no such GGUF file")
    if model.startswith(("/", ".", "~")) or model.count("/") > 1:
        raise FileNotFoundError(f"model directory {model!r} does not exist")
    return _download(model, cache_dir)


def _lone_gguf(path: str) -> str | None:
    """The GGUF file of a directory without ``config.json`` (None if it has a config).

    ``ValueError`` when such a directory holds several GGUF files (name one).
    """
    if os.path.isfile(os.path.join(path, "config.json")):
        return None
    files = sorted(str(f) for f in Path(path).glob("*.gguf"))
    if len(files) > 1:
        raise ValueError(
            f"{path}: holds {len(files)} GGUF files ({', '.join(Path(f).name for f in files)}); "
            "pass one file as --model"
        )
    return files[0] if files else None


def _download(repo_id: str, cache_dir: str | None) -> str:
    from huggingface_hub import snapshot_download

    try:
        cached = snapshot_download(
            repo_id, cache_dir=cache_dir, allow_patterns=_HUB_PATTERNS, local_files_only=True
        )
        if os.path.isfile(os.path.join(cached, "config.json")) and any(
            Path(cached).glob("*.safetensors")
        ):
            return cached
    except Exception:  # noqa: BLE001 - not in the local cache: try the network
        pass
    try:
        return snapshot_download(repo_id, cache_dir=cache_dir, allow_patterns=_HUB_PATTERNS)
    except Exception as exc:  # noqa: BLE001 - hub raises many types; report one
        raise ValueError(
            f"model {repo_id!r} is not 'tiny', not a local directory, and could not be "
            f"fetched from the Hugging Face hub ({type(exc).__name__}: {exc})"
        ) from exc


def resolve_dtype(dtype: str | torch.dtype, config: Any, device: str | torch.device) -> torch.dtype:
    """Torch dtype for ``dtype`` ("auto" | "float32" | "bfloat16" | "float16")."""
    if isinstance(dtype, torch.dtype):
        return dtype
    name = _DTYPE_ALIASES.get(dtype, dtype)
    if name != "auto":
        if name not in DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; use auto, {', '.join(DTYPES)}")
        return DTYPES[name]
    configured = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(configured, str):
        configured = DTYPES.get(configured, torch.float32)
    if configured not in DTYPES.values():
        return torch.float32
    if configured == torch.float16 and torch.device(device).type == "cpu":
        return torch.float32
    return configured


def safetensors_files(path: str) -> list[str]:
    """The checkpoint's safetensors files, in load order.

    Uses the shard index when present, else ``model.safetensors``, else every
    ``*.safetensors`` except Mistral's ``consolidated*`` (different names).
    """
    root = Path(path)
    index = root / _INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
        absent = [f for f in files if not (root / f).is_file()]
        if absent:
            raise FileNotFoundError(f"shards listed in {index} are missing: {', '.join(absent)}")
        return [str(root / f) for f in files]
    if (root / "model.safetensors").is_file():
        return [str(root / "model.safetensors")]
    files = sorted(
        str(f) for f in root.glob("*.safetensors") if not f.name.startswith("consolidated")
    )
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in model directory {path!r}")
    return files


def iter_safetensors(files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, cpu tensor)`` for every tensor, one at a time (memory stays low)."""
    from safetensors import safe_open

    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, f.get_tensor(name)


def load_model(
    model: str,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "cpu",
    max_model_len: int | None = None,
    hf_config: Any = None,
) -> tuple[nn.Module, Any]:
    """Resolve, build and fill the model; returns ``(model, hf_config)``.

    The model is in eval mode on ``device`` with every weight loaded
    (``ValueError`` names missing/unexpected/mis-shaped ones). When
    ``max_model_len`` is given it must not exceed ``model.max_context_len``
    (rope table size, sliding window). ``hf_config``: the model's config when the caller has
    it already (``hf_config.config_namespace``); else read from the directory.
    """
    path = resolve_model_path(model)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"model directory {path!r} does not exist")
    config = hf_config if hf_config is not None else load_config(path)
    model_cls = get_model_class(
        getattr(config, "architectures", None), getattr(config, "model_type", None)
    )
    files = safetensors_files(path)
    torch_dtype = resolve_dtype(dtype, config, device)
    with torch.device(device):
        net = model_cls(config, torch_dtype)
    if max_model_len is not None and max_model_len > net.max_context_len:
        raise ValueError(
            f"max_model_len {max_model_len} exceeds what {model!r} supports "
            f"({net.max_context_len}: max_position_embeddings or sliding_window)"
        )
    net.load_weights(iter_safetensors(files))
    return net.eval(), config
