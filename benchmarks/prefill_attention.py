"""Prefill attention on a GPU: the paged Triton kernel vs torch SDPA vs the engine's split.

    .venv/bin/python benchmarks/prefill_attention.py
    .venv/bin/python benchmarks/prefill_attention.py --lengths 512,2048 --dtype float16

Attention only (no projections), Llama-3.2-1B heads: 32 query / 8 KV heads of 64, bf16,
block size 16. Each row is one step of prefix-free prompts filling ``--tokens`` (8192) query
tokens: ``tokens // L`` prompts of length L, and a ``mixed`` row of seeded random lengths
64..2048. Columns, TFLOP/s (causal: 4 * heads * head_dim * L * (L + 1) / 2 per prompt) with the
median of ``--reps`` timed steps (CUDA events):

* triton        ``kernels.triton_attention.paged_attention`` over the cache (K/V written first)
* sdpa/seq      ``F.scaled_dot_product_attention(is_causal, enable_gqa)`` once per prompt
* sdpa/batch    one such call over ``[P, H, L, D]`` (equal lengths only)
* split         ``kernels.prefill_attention.attend``, what the engine runs with
                ``--prefill-attention sdpa`` / ``auto`` (one varlen flash launch per step)

Without CUDA it prints that there is no GPU and exits 0.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tandem.kernels import AttentionMetadata, prefill_attention  # noqa: E402
from tandem.kernels.dispatch import paged_attention, write_kv_cache  # noqa: E402

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 64, 16
SEED = 0
DEVICE = "cuda"


def time_ms(fn, reps: int) -> float:
    """Median milliseconds of ``fn()`` over ``reps`` runs after three warm-ups."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def step_of(lengths: list[int], dtype: torch.dtype, gen: torch.Generator):
    """q, k, v ``[T, H, D]``, a cache holding k/v, and the step's metadata (all fresh)."""
    num_tokens = sum(lengths)
    q, k, v = (
        torch.randn(num_tokens, h, HEAD_DIM, generator=gen).to(DEVICE, dtype)
        for h in (NUM_HEADS, NUM_KV_HEADS, NUM_KV_HEADS)
    )
    tables, next_block = [], 0
    for length in lengths:
        n = -(-length // BLOCK_SIZE)
        tables.append(list(range(next_block, next_block + n)))
        next_block += n
    cache = torch.zeros(
        next_block, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype=dtype, device=DEVICE
    )
    meta = AttentionMetadata.build(tables, lengths, lengths, BLOCK_SIZE, DEVICE)
    write_kv_cache(k, v, cache, meta.slot_mapping)
    return q, k, v, cache, meta


def row(name: str, lengths: list[int], dtype: torch.dtype, reps: int, gen) -> list[str]:
    q, k, v, cache, meta = step_of(lengths, dtype, gen)
    scale = HEAD_DIM**-0.5
    flops = sum(4 * NUM_HEADS * HEAD_DIM * n * (n + 1) // 2 for n in lengths)
    starts = [sum(lengths[:i]) for i in range(len(lengths))]

    def per_seq(x: torch.Tensor, i: int) -> torch.Tensor:
        return x[starts[i] : starts[i] + lengths[i]].transpose(0, 1)[None]

    def sdpa_seq() -> None:
        for i in range(len(lengths)):
            F.scaled_dot_product_attention(
                per_seq(q, i), per_seq(k, i), per_seq(v, i), is_causal=True, scale=scale,
                enable_gqa=True,
            )  # fmt: skip

    def sdpa_batch() -> None:
        p, n = len(lengths), lengths[0]
        qb, kb, vb = (x.view(p, n, x.shape[1], HEAD_DIM).transpose(1, 2) for x in (q, k, v))
        F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=scale, enable_gqa=True)

    def split() -> None:
        meta.sdpa_prefills = True
        prefill_attention.attend(q, k, v, cache, meta, scale)

    def triton() -> None:
        meta.sdpa_prefills = False
        paged_attention(q, cache, meta, scale)

    cells = [name, str(len(lengths))]
    runs = [triton, sdpa_seq, sdpa_batch if len(set(lengths)) == 1 else None, split]
    for fn in runs:
        cells.append("-" if fn is None else f"{flops / (time_ms(fn, reps) * 1e-3) / 1e12:.0f}")
    meta.sdpa_prefills = True
    probe_q, probe_k = q[:1], k[:1]
    cells.append(
        "flash_varlen" if prefill_attention.flash_varlen_supported(probe_q, probe_k) else "groups"
    )
    return cells


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--lengths", default="128,512,1024,2048,4096")
    p.add_argument("--tokens", type=int, default=8192, help="query tokens per step")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("prefill_attention: no GPU (torch.cuda.is_available() is False); nothing measured")
        return 0
    import triton

    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(SEED)
    rows = []
    for length in (int(x) for x in args.lengths.split(",")):
        rows.append(
            row(f"L={length}", [length] * max(1, args.tokens // length), dtype, args.reps, gen)
        )
    mixed, total = [], 0
    while total < args.tokens:
        n = int(torch.randint(64, 2049, (1,), generator=gen))
        n = min(n, args.tokens - total) if args.tokens - total >= 64 else n
        mixed.append(n)
        total += n
    rows.append(row("mixed 64..2048", mixed, dtype, args.reps, gen))

    gpu = torch.cuda.get_device_name()
    print(f"GPU: {gpu}; {datetime.date.today().isoformat()}; torch {torch.__version__}, "
          f"triton {triton.__version__}")  # fmt: skip
    print(
        f"prefix-free prefill attention, {NUM_HEADS}/{NUM_KV_HEADS} heads x {HEAD_DIM}, "
        f"{args.dtype}, ~{args.tokens} query tokens per step; TFLOP/s (median of {args.reps})"
    )
    header = ["prompts", "n", "triton", "sdpa/seq", "sdpa/batch", "split", "split runs"]
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
    for cells in [header] + rows:
        print(
            "  ".join(
                c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
