"""Tensor parallelism: what splitting an engine over N workers costs.

Sections (one table each; ``--section`` picks, default all):

  step     Per-step overhead of TP=N vs TP=1 on the same model: decode step
           time, and on rank 0 per step the broadcast of the SchedulerOutput
           (msgpack encode + one ZMQ send per worker), the wait for the
           workers' replies after rank 0's own forward, and the time inside
           the collectives (all-reduce after o_proj/down_proj/embedding, the
           logits all-gather), waits for the slowest rank included. Also the
           vocab-parallel lm_head's trade: its all-gather against computing
           the full-vocab matmul on one rank (replicated lm_head).
  kv-read  KV READ GB/s and descriptors per (P TP, D TP) pairing and KV layout,
           next to the homogeneous pairing with as many reading ranks
           (``benchmarks/tp_kv_read.py``: one process per rank, real NIXL).

On CPU (gloo, one torch thread per rank) the compute does not speed up with
N on a shared 2-core machine; the overheads are the point. Run:

    python benchmarks/tensor_parallel.py [--section step] [--tp 2] [--model tiny]
        [--batch 8] [--prompt-len 64] [--output-len 64] [--repeat 3]
    python benchmarks/tensor_parallel.py --section kv-read [--sizes-mib 16 64 256]
        [--iters 5] [--pairings 1x2 2x1] [--layouts blocks_first head_major]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._machine import machine  # noqa: E402
from benchmarks.tp_kv_read import add_arguments as add_kv_read_arguments  # noqa: E402
from benchmarks.tp_kv_read import section_kv_read  # noqa: E402

# ---- section "step": per-step overhead (tp-model) ----------------------------


def _decode_steps(tp: int, args: argparse.Namespace) -> dict[str, float]:
    """Run one batch to completion; per decode step: medians of the step and,
    with TP > 1, of rank 0's broadcast / reply wait / collective times."""
    import torch

    from tandem.wire.engine_protocol import EngineRequest, SamplingParams
    from tandem.workers.config import EngineConfig
    from tandem.workers.engine.llm import LLM

    cfg = EngineConfig.from_flat(
        model=args.model,
        tensor_parallel_size=tp,
        torch_threads=1,
        num_kv_blocks=args.batch * (-(-(args.prompt_len + args.output_len) // 16)) + 8,
        max_num_batched_tokens=max(2048, args.batch * args.prompt_len),
        seed=0,
    )
    rows: dict[str, list[float]] = {k: [] for k in ("step", "bcast", "reply", "ar", "ag")}
    counts: dict[str, list[float]] = {"ar": [], "bytes": []}
    with LLM(cfg) as llm:
        engine = llm.engine
        g = torch.Generator().manual_seed(0)
        vocab = engine.model.vocab_size
        sp = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
        for i in range(args.batch):
            prompt = torch.randint(3, vocab, (args.prompt_len,), generator=g).tolist()
            engine.add_request(EngineRequest(f"r{i}", prompt, sp))
        ex = engine.tp
        while engine.has_work():
            before = _counters(ex) if ex is not None else {}
            start_s = time.perf_counter()
            engine.step()
            step_s = time.perf_counter() - start_s
            if engine.last_step_num_tokens != args.batch:
                continue  # a prefill step: not the decode loop
            rows["step"].append(step_s)
            if ex is not None:
                after = _counters(ex)
                delta = {k: after[k] - before[k] for k in after}
                rows["bcast"].append(delta["bcast"])
                rows["reply"].append(delta["reply"])
                rows["ar"].append(delta["ar"])
                rows["ag"].append(delta["ag"])
                counts["ar"].append(delta["n_ar"])
                counts["bytes"].append(delta["bytes"])
        engine.check_integrity()
    med = {k: statistics.median(v) * 1e6 if v else 0.0 for k, v in rows.items()}
    med["n_ar"] = statistics.median(counts["ar"]) if counts["ar"] else 0
    med["bytes"] = statistics.median(counts["bytes"]) if counts["bytes"] else 0
    med["hidden"] = engine.model.config.hidden_size
    med["vocab"] = engine.model.vocab_size
    return med


def _counters(ex) -> dict[str, float]:
    g = ex.group
    return {
        "bcast": ex.broadcast_s,
        "reply": ex.reply_wait_s,
        "ar": g.all_reduce_s,
        "ag": g.all_gather_s,
        "n_ar": g.num_all_reduce,
        "bytes": ex.broadcast_bytes,
    }


def _lm_head_us(batch: int, hidden: int, vocab: int, tp: int, repeat: int = 200) -> tuple:
    """In-process: the logits matmul over the full vocab vs one rank's shard."""
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(1)
    x = torch.randn(batch, hidden)
    full = torch.randn(vocab, hidden)
    shard = full[: -(-vocab // tp)].clone()
    out = []
    for w in (full, shard):
        F.linear(x, w)
        start_s = time.perf_counter()
        for _ in range(repeat):
            F.linear(x, w)
        out.append((time.perf_counter() - start_s) / repeat * 1e6)
    return tuple(out)


def _bare_peer(rank: int, size: int, port: int, shape: tuple, repeat: int) -> None:
    import torch

    from tandem.workers.parallel.group import TPGroup, make_store

    torch.set_num_threads(1)
    group = TPGroup.connect(make_store(rank, size, "127.0.0.1", port, 60), rank, size, "cpu", 60)
    t = torch.ones(shape)
    for _ in range(repeat):
        group.all_reduce(t)


def _bare_all_reduce_us(tp: int, shape: tuple, repeat: int = 500) -> float:
    """Median µs of one gloo all-reduce of ``shape`` fp32 over ``tp`` processes
    doing nothing else (the collective's own cost, without compute skew)."""
    import torch

    from tandem.workers.parallel.group import TPGroup, make_store

    store = make_store(0, tp, "127.0.0.1", 0, 60)
    ctx = torch.multiprocessing.get_context("spawn")
    peers = [
        ctx.Process(target=_bare_peer, args=(r, tp, store.port, shape, repeat))
        for r in range(1, tp)
    ]
    for p in peers:
        p.start()
    group = TPGroup.connect(store, 0, tp, "cpu", 60)
    t = torch.ones(shape)
    times = []
    for _ in range(repeat):
        start_s = time.perf_counter()
        group.all_reduce(t)
        times.append(time.perf_counter() - start_s)
    for p in peers:
        p.join(60)
    return statistics.median(times) * 1e6


def section_step(args: argparse.Namespace) -> None:
    runs = {1: [], args.tp: []}
    for _ in range(args.repeat):
        for tp in runs:
            runs[tp].append(_decode_steps(tp, args))
    med = {tp: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for tp, rs in runs.items()}
    base, tpr = med[1], med[args.tp]
    full_us, shard_us = _lm_head_us(args.batch, base["hidden"], base["vocab"], args.tp)
    bare_us = _bare_all_reduce_us(args.tp, (args.batch, int(base["hidden"])))
    load = os.getloadavg()
    print(
        f"\n## step overhead: TP={args.tp} vs TP=1 (model {args.model}, batch {args.batch} "
        f"decoding, prompt {args.prompt_len}, output {args.output_len}, gloo, "
        f"1 torch thread per rank, median of {args.repeat} runs)"
    )
    print(f"machine: {machine()}; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}\n")
    print(f"| quantity (median per decode step) | TP=1 | TP={args.tp} |")
    print("|---|---:|---:|")
    print(f"| step, µs | {base['step']:.0f} | {tpr['step']:.0f} |")
    print(f"| broadcast: encode + {args.tp - 1} ZMQ send(s), µs | - | {tpr['bcast']:.1f} |")
    print(f"| broadcast bytes | - | {tpr['bytes']:.0f} |")
    print(f"| wait for worker replies after rank 0's forward, µs | - | {tpr['reply']:.1f} |")
    print(f"| all-reduces per step | - | {tpr['n_ar']:.0f} |")
    print(f"| all-reduce total (rank 0, incl. waiting), µs | - | {tpr['ar']:.0f} |")
    print(
        f"| one all-reduce [{args.batch}, {base['hidden']:.0f}] fp32, ranks doing nothing "
        f"else, µs | - | {bare_us:.1f} |"
    )
    print(f"| logits all-gather, µs | - | {tpr['ag']:.1f} |")
    overhead = tpr["bcast"] + tpr["reply"] + tpr["ar"] + tpr["ag"]
    print(f"| TP overhead on rank 0 (sum of the four), µs | - | {overhead:.0f} |")
    print(
        f"\nlm_head alternative (one rank, in-process, vocab {base['vocab']:.0f}, "
        f"hidden {base['hidden']:.0f}): full-vocab matmul {full_us:.1f} µs, one shard's "
        f"{shard_us:.1f} µs; replicating the lm_head trades the all-gather above for "
        f"{full_us - shard_us:.1f} µs more matmul and vocab x hidden more memory per rank."
    )


# ---- section registry -----------------------------------------------------------

SECTIONS = {"step": section_step, "kv-read": section_kv_read}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--section", choices=[*SECTIONS, "all"], default="all")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--model", default="tiny")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--repeat", type=int, default=3)
    add_kv_read_arguments(p)
    args = p.parse_args()
    for name, fn in SECTIONS.items():
        if args.section in (name, "all"):
            fn(args)


if __name__ == "__main__":
    main()
