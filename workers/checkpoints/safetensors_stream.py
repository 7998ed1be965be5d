"""Write a safetensors file one tensor at a time (never the whole state dict).

The format is an 8-byte little-endian header length, a JSON header naming
each tensor's dtype, shape and byte range, then the raw bytes::

    | u64 n | {"name": {"dtype", "shape", "data_offsets": [begin, end]}, ...} | bytes |

Shapes are known before any data (GGUF lists them up front), so the header
is written first and each tensor's bytes follow as the tensor is produced.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable
from math import prod

import torch

_DTYPE_CODES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}


def write_safetensors_streaming(
    path: str,
    shapes: list[tuple[str, tuple[int, ...]]],
    tensors: Iterable[tuple[str, torch.Tensor]],
    dtype: torch.dtype = torch.float32,
) -> None:
    """Write ``tensors`` (same names and order as ``shapes``) to ``path`` in ``dtype``.

    Each tensor is cast and written before the next is drawn, so memory holds
    one tensor at a time. Raises ``ValueError`` when a tensor's name or shape
    differs from the announced one (the file is then incomplete: write to a
    temporary location and rename on success).
    """
    code = _DTYPE_CODES[dtype]
    item_size = torch.empty((), dtype=dtype).element_size()
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in shapes:
        num_bytes = prod(shape) * item_size
        header[name] = {
            "dtype": code,
            "shape": list(shape),
            "data_offsets": [offset, offset + num_bytes],
        }
        offset += num_bytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        count = 0
        for (name, shape), (got_name, tensor) in zip(shapes, tensors, strict=True):
            if got_name != name or tuple(tensor.shape) != tuple(shape):
                raise ValueError(
                    f"tensor {count}: expected {name} {tuple(shape)}, "
                    f"got {got_name} {tuple(tensor.shape)}"
                )
            data = tensor.detach().to("cpu", dtype).contiguous().view(torch.uint8)
            f.write(data.numpy().data)
            count += 1
