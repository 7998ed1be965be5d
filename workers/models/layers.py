"""Building blocks shared by the Llama-family models: Linear, RMSNorm, SiLU MLP.

Norms and the MLP activation go through ``kernels.dispatch``: one Triton launch each on CUDA,
the torch reference (``kernels.fused_reference``, the exact HF numerics) on CPU.

Parameters are created with ``torch.empty`` (no init: the loader overwrites
every one of them) and never require grad.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem.kernels import dispatch


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class Linear(nn.Module):
    """``y = x @ W.T (+ b)``.

    A fused Linear stacks several HF weights along the output dimension, e.g.
    ``qkv_proj`` holds ``q_proj``, ``k_proj`` and ``v_proj`` (rows in that
    order). ``shard_names`` are those HF module names (siblings of this
    module); ``out_sizes`` their row counts. One matmul instead of three is
    cheaper on CPU, where small matmuls are dominated by call overhead.

    ``weight`` is ``[out, in]`` as in HF; with ``transposed`` (the default) it
    is a transposed view of an ``[in, out]`` row-major buffer, so ``x @ W.T``
    is a plain row-major matmul, which MKL runs 20-40% faster for
    decode-sized batches on one CPU thread. Very wide outputs (the LM head)
    are faster in HF's layout with two threads, hence the switch.
    """

    def __init__(
        self,
        in_features: int,
        out_sizes: list[int],
        bias: bool,
        dtype: torch.dtype,
        shard_names: list[str] | None = None,
        transposed: bool = True,
    ) -> None:
        super().__init__()
        if shard_names is not None and len(shard_names) != len(out_sizes):
            raise ValueError("shard_names and out_sizes must have the same length")
        self.out_sizes = list(out_sizes)
        self.shard_names = shard_names
        if transposed:
            weight = torch.empty(in_features, sum(out_sizes), dtype=dtype).t()
        else:
            weight = torch.empty(sum(out_sizes), in_features, dtype=dtype)
        self.weight = nn.Parameter(weight, requires_grad=False)
        if bias:
            self.bias = _param(sum(out_sizes), dtype=dtype)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


# rows of a CPU fp32 LM-head matmul computed as ``W @ x.T`` (see ``lm_head_logits``)
SMALL_LOGITS_ROWS = 8


def lm_head_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``hidden @ weight.T`` for the LM head: ``[N, hidden] x [vocab, hidden] -> [N, vocab]``.

    On CPU in float32, ``F.linear`` with 2 to ``SMALL_LOGITS_ROWS`` rows (a speculative
    verification at batch 1: the last token and its drafts) runs MKL's general matmul,
    which does not stream the weight (113 MiB for smollm2's 49k vocabulary) the way the
    one-row matrix-vector product does (it packs it, as far as we can tell): 2 rows cost
    2.2-2.7x one row. ``weight @ hidden.T`` takes another kernel, which streams it: 2-5
    rows then cost about what one row does (one torch thread, this repository's CPU box; issue #26 in
    docs/benchmarks.md). One row and larger batches keep ``F.linear``. The values are
    the same matmul's up to float32 rounding order (greedy outputs are unchanged).
    """
    rows = hidden.shape[0]
    if (
        2 <= rows <= SMALL_LOGITS_ROWS
        and hidden.device.type == "cpu"
        and hidden.dtype == torch.float32
        and weight.dtype == torch.float32
        and weight.is_contiguous()
    ):
        return torch.mm(weight, hidden.t()).t().contiguous()
    return F.linear(hidden, weight)


class Embedding(nn.Module):
    """Token embedding table ``[vocab, hidden]``."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = _param(vocab_size, hidden_size, dtype=dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class RMSNorm(nn.Module):
    """RMSNorm over the last dim, computed in float32 like transformers'."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _param(size, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dispatch.rms_norm(x, self.weight, self.eps)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(x + residual), x + residual)``: the residual add fused with the norm."""
        return dispatch.add_rms_norm(x, residual, self.weight, self.eps)


class SiluMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with gate and up fused into one matmul."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, bias: bool, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = Linear(
            hidden_size,
            [intermediate_size, intermediate_size],
            bias,
            dtype,
            shard_names=["gate_proj", "up_proj"],
        )
        self.down_proj = Linear(intermediate_size, [hidden_size], bias, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The fresh matmul output is ours: the CPU path computes in place in it.
        return self.down_proj(dispatch.silu_and_mul(self.gate_up_proj(x)))
