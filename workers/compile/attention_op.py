"""A layer's KV-cache write + attention as ONE opaque op for ``torch.compile``.

Under compile the traced graph holds every matmul, norm, rope and activation of the model, with
one ``tandem::attention`` call per layer in between::

    embed -> [norm, qkv_proj, rope] -> attention(L0) -> [o_proj, add+norm, mlp, add+norm,
             qkv_proj, rope] -> attention(L1) -> ... -> final norm    (one graph, no breaks)

The op is opaque because what it does depends on the step, not on shapes: the paged cache is
written in place at the step's slots, and the attention plan (dense decode rows, SDPA prefill
split, reference groups) is built on the host from the step's metadata. So neither the cache nor
the metadata is an argument: they are the current step's, set by ``step_context`` around the
compiled call (vLLM's forward context does the same), and the compiler sees a pure function of
q/k/v. Declaring the cache as mutated instead would make the compiler copy it; passing the
metadata would make it guard on (and recompile for) the step's lengths. The traced model gets
``kv_cache=None`` and ``COMPILED_STEP`` as its metadata (``slot_mapping`` None).

The models call ``rope_write_kv`` and ``attend`` below. Eager (not compiling) they are the plain
calls (the fused rope + KV write, then attention over the cache); while compiling, the rope is
traced and the write moves into the op.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from tandem.kernels import dispatch, fused_reference
from tandem.workers.runner import attention as attention_module
from tandem.workers.runner.attention import StepMetadata

_step = threading.local()


class CompiledStep:
    """The metadata argument the traced model sees; the real one is in ``step_context``."""

    slot_mapping = None


COMPILED_STEP = CompiledStep()


@contextmanager
def step_context(kv_cache: torch.Tensor, meta: StepMetadata) -> Iterator[None]:
    """Make ``kv_cache`` and ``meta`` the ones ``tandem::attention`` uses in this thread."""
    previous = getattr(_step, "current", None)
    _step.current = (kv_cache, meta)
    try:
        yield
    finally:
        _step.current = previous


def rope_write_kv(
    layer_idx: int,
    qk: torch.Tensor,
    v: torch.Tensor,
    rope: tuple[torch.Tensor, torch.Tensor],
    kv_cache: Any,
    slot_mapping: Any,
) -> torch.Tensor:
    """Rotate ``qk`` ``[T, Hq + Hkv, D]`` and write the rotated keys and ``v`` to layer
    ``layer_idx`` of ``kv_cache`` at ``slot_mapping`` (``kernels.dispatch.rope_write_kv``).
    While compiling only the rotation: ``attend`` writes."""
    cos, sin = rope
    if torch.compiler.is_compiling():
        return fused_reference.rope(qk, cos, sin)
    return dispatch.rope_write_kv(qk, v, cos, sin, kv_cache[:, layer_idx], slot_mapping)


def attend(
    layer_idx: int,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: Any,
    meta: Any,
    scale: float,
) -> torch.Tensor:
    """Causal attention ``[T, Hq, D]`` of ``q`` over layer ``layer_idx`` of the cache, which
    holds this step's ``k``/``v`` (``workers.runner.attention.attend``). While compiling: the opaque
    op, which writes ``k``/``v`` first."""
    if torch.compiler.is_compiling():
        return torch.ops.tandem.attention(q, k, v, layer_idx, scale)
    return attention_module.attend(layer_idx, q, k, v, kv_cache, meta, scale)


@torch.library.custom_op("tandem::attention", mutates_args=())
def _attention_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_idx: int, scale: float
) -> torch.Tensor:
    current = getattr(_step, "current", None)
    if current is None:
        raise RuntimeError("tandem::attention called outside step_context()")
    kv_cache, meta = current
    out = attention_module.attention(layer_idx, q, k, v, kv_cache, meta, scale)
    return out.contiguous()  # the layout the fake below promises


@_attention_op.register_fake
def _(q, k, v, layer_idx, scale):
    return q.new_empty(q.shape)
