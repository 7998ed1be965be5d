"""Read a GGUF file (llama.cpp's checkpoint format) with the ``gguf`` package.

    reader = open_gguf(path)          # GGUFError unless a whole, supported GGUF file
    tensor_shapes(reader)             # [(hf_name, shape)] in file order
    iter_hf_tensors(reader)           # (hf_name, fp32 tensor), dequantized one at a time

GGUF names map block by block to HF names::

    token_embd.weight          -> model.embed_tokens.weight
    blk.3.attn_q.weight        -> model.layers.3.self_attn.q_proj.weight
    blk.3.ffn_down.weight      -> model.layers.3.mlp.down_proj.weight
    output_norm.weight, output.weight -> model.norm.weight, lm_head.weight

llama.cpp's converter reorders the rows of a Llama model's q and k
projections (each head's two rotate-half halves are interleaved pairwise);
for architecture ``llama`` the rows are put back, as transformers does when
it loads the same file. Qwen2/Qwen3 files are stored in HF order.

Every check that can fail (magic, truncation, architecture, tensor types,
tensor names) runs in ``open_gguf``, before a caller writes anything.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

# GGUF ``general.architecture`` -> HF model_type (the same names for these).
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
# Tensor types we dequantize (with gguf.quants) and test against transformers.
SUPPORTED_TYPES = (
    "F32",
    "F16",
    "BF16",
    "Q4_0",
    "Q4_1",
    "Q5_0",
    "Q5_1",
    "Q8_0",
    "Q2_K",
    "Q3_K",
    "Q4_K",
    "Q5_K",
    "Q6_K",
)
# Derived tensors llama.cpp stores for its own kernels; the config has the same facts.
_IGNORED_TENSORS = ("rope_freqs.weight",)
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_MAGIC = b"GGUF"
_ROWS_PER_CHUNK = 4096


class GGUFError(ValueError):
    """A GGUF file we cannot load; the message names the file and the cause (one line)."""

    def __init__(self, path: str, cause: str) -> None:
        self.path = path
        super().__init__(f"{path}: {' '.join(cause.split())}")


def is_gguf_file(path: str) -> bool:
    """True when ``path`` is a file starting with the GGUF magic bytes."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == _MAGIC
    except OSError:
        return False


def open_gguf(path: str) -> Any:
    """A ``gguf.GGUFReader`` for ``path`` after every check this module makes.

    Raises ``FileNotFoundError`` for a missing file and ``GGUFError`` for a
    file that is not GGUF, is truncated or corrupt, has an architecture we do
    not serve, a tensor type outside ``SUPPORTED_TYPES`` or an unknown tensor.
    """
    from gguf import GGUFReader

    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such GGUF file")
    if not is_gguf_file(path):
        raise GGUFError(path, "not a GGUF file (the first bytes are not 'GGUF')")
    try:
        reader = GGUFReader(path)
    except Exception as exc:  # noqa: BLE001 - the reader raises many types on bad data
        raise GGUFError(
            path, f"truncated or corrupt GGUF file ({type(exc).__name__}: {exc})"
        ) from exc
    arch = metadata(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GGUFError(
            path,
            f"architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}",
        )
    for t in reader.tensors:
        type_name = t.tensor_type.name
        if type_name not in SUPPORTED_TYPES:
            raise GGUFError(
                path,
                f"tensor {t.name!r} has quantization type {type_name}, which tandem cannot "
                f"dequantize; supported: {', '.join(SUPPORTED_TYPES)}",
            )
        if t.name not in _IGNORED_TENSORS and hf_tensor_name(t.name) is None:
            raise GGUFError(path, f"tensor {t.name!r} has no HF counterpart for {arch!r}")
    return reader


def metadata(reader: Any, key: str, default: Any = None) -> Any:
    """Value of a metadata key (str, int, float, list), or ``default`` when absent."""
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def hf_tensor_name(gguf_name: str) -> str | None:
    """HF name of a GGUF tensor (``None`` when it has none)."""
    stem, _, suffix = gguf_name.rpartition(".")
    if suffix not in ("weight", "bias"):
        return None
    if stem.startswith("blk."):
        parts = stem.split(".", 2)
        if len(parts) != 3 or not parts[1].isdigit() or parts[2] not in _BLOCK_NAMES:
            return None
        return f"model.layers.{parts[1]}.{_BLOCK_NAMES[parts[2]]}.{suffix}"
    mapped = _GLOBAL_NAMES.get(stem)
    return None if mapped is None else f"{mapped}.{suffix}"


def tensor_shapes(reader: Any) -> list[tuple[str, tuple[int, ...]]]:
    """``(hf_name, shape)`` of every tensor ``iter_hf_tensors`` yields, in the same order.

    GGUF lists dimensions fastest-first; torch shapes are the reverse.
    """
    return [
        (hf_tensor_name(t.name), tuple(int(d) for d in reversed(t.shape.tolist())))
        for t in reader.tensors
        if t.name not in _IGNORED_TENSORS
    ]


def iter_hf_tensors(reader: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """``(hf_name, float32 tensor)`` per tensor, dequantized one at a time."""
    from gguf.quants import dequantize

    arch = metadata(reader, "general.architecture")
    num_heads = int(metadata(reader, f"{arch}.attention.head_count"))
    num_kv_heads = int(metadata(reader, f"{arch}.attention.head_count_kv", num_heads))
    shapes = dict(tensor_shapes(reader))
    for t in reader.tensors:
        if t.name in _IGNORED_TENSORS:
            continue
        name = hf_tensor_name(t.name)
        tensor = _dequantize_rows(t.data, t.tensor_type, shapes[name], dequantize)
        if arch == "llama" and ".attn_q." in t.name:
            tensor = _unpermute_rope_rows(tensor, num_heads)
        elif arch == "llama" and ".attn_k." in t.name:
            tensor = _unpermute_rope_rows(tensor, num_kv_heads)
        yield name, tensor


def _dequantize_rows(
    data: Any, qtype: Any, shape: tuple[int, ...], dequantize: Any
) -> torch.Tensor:
    """float32 tensor of ``shape`` from a GGUF tensor, ``_ROWS_PER_CHUNK`` rows at a time.

    The dequantizer's numpy temporaries are several times its output; in
    chunks they stay small next to the one output tensor.
    """
    out = torch.empty(shape, dtype=torch.float32)
    if len(shape) != 2 or data.shape[0] != shape[0]:
        out.copy_(torch.from_numpy(np.array(dequantize(data, qtype), np.float32)).reshape(shape))
        return out
    for start in range(0, shape[0], _ROWS_PER_CHUNK):
        rows = np.array(dequantize(data[start : start + _ROWS_PER_CHUNK], qtype), np.float32)
        out[start : start + rows.shape[0]] = torch.from_numpy(rows.reshape(rows.shape[0], -1))
    return out


def _unpermute_rope_rows(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    # Per head, llama.cpp stores rows as pairs (i, i + half) side by side;
    # HF keeps the first halves, then the second halves (rotate-half layout).
    #   llama.cpp: [h][i][2]  ->  HF: [h][2][i]
    half = w.shape[0] // num_heads // 2
    rest = tuple(w.shape[1:])
    return w.reshape(num_heads, half, 2, *rest).transpose(1, 2).reshape(w.shape).contiguous()
