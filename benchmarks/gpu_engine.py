"""GPU engine benchmark (issue #10): one table that names the GPU.

    .venv/bin/python benchmarks/gpu_engine.py            # the 1B-shaped workload, full size
    .venv/bin/python benchmarks/gpu_engine.py --quick    # 64 x 128 -> 64 (a smoke run)

Rows, all in one process on one seeded random Llama-3.2-1B-shaped checkpoint (hidden 2048,
16 layers, 32 heads / 8 KV heads, intermediate 8192, vocab 128256, tied embeddings, bf16):

* workload: 256 prompts x 512 tokens -> 256 new tokens each, greedy, EOS ignored: tok/s and
  seconds for Tandem, transformers on one static batch (``generate``) and transformers'
  continuous batching (``generate_batch``); engines from ``benchmarks/offline_throughput.py``
* decode step ms at batch 1 / 64 / 256 (context = prompt length), engine steps timed after
  every sequence is decoding (scheduler + graph replay + sampling + the one sync), next to the
  HBM floor: (weight bytes + KV bytes the step reads) / ``--hbm-tb-s``; the same rows again
  with ``--async-scheduling`` (the overlapped loop)
* prefill TFLOP/s: prompts of ``--prefill-len`` tokens through the engine, matmul + attention
  FLOPs over the measured time
* with ``--compile-rows``, torch.compile vs eager (``--compile-model``): decode step at batch
  64, one prefill, compile seconds (``compile_rows``); ``--compile-only``: these rows alone
  (``gpu_session.sh extras``)
* NIXL VRAM READ GB/s, raw and through the connector, next to a device copy:
  ``benchmarks/gpu_nixl.py``'s ``vram_read_rows`` (a row marked not measured if it cannot be
  imported)

Targets (issue #10, H100): decode step <= 2x the floor at batch 64 and 256; the workload >= 3x
transformers static; connector READ >= 70% of a device copy from 16 MiB.

Without CUDA it prints that there is no GPU and exits 0.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import sys
import tempfile
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.offline_throughput import (  # noqa: E402
    make_prompts,
    run_hf_cb,
    run_hf_static,
    run_tandem,
)

ONE_B_CONFIG = {
    "vocab_size": 128256,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "tie_word_embeddings": True,
}
# HBM bandwidth used for the floor, TB/s; the H100 floors use 3.0
HBM_TB_S = {"H100": 3.0, "H200": 4.8, "A100": 2.0, "L40S": 0.86}
SEED = 0


def no_gpu_message() -> str | None:
    """Why nothing can be measured here, or None when a CUDA device is usable."""
    if not torch.cuda.is_available():
        return "gpu_engine: no GPU (torch.cuda.is_available() is False); nothing measured"
    return None


def make_1b_checkpoint(tmp_dir: str, max_position_embeddings: int | None = None) -> str:
    """The seeded random 1B-shaped checkpoint (bf16, written from CUDA); a longer
    ``max_position_embeddings`` (Llama-3.2-1B's own is 131072) lets a profile measure long
    contexts."""
    from transformers import LlamaConfig, LlamaForCausalLM

    path = os.path.join(tmp_dir, "llama-1b-shaped")
    torch.manual_seed(SEED)
    shape = dict(ONE_B_CONFIG)
    if max_position_embeddings:
        shape["max_position_embeddings"] = max_position_embeddings
    config = LlamaConfig(**shape, eos_token_id=2, bos_token_id=1, pad_token_id=0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path)
    del model
    torch.cuda.empty_cache()
    return path


def _release() -> None:
    """Free the last engine's GPU memory before the next one sizes its KV cache."""
    gc.collect()
    torch.cuda.empty_cache()


def timed(fn, *args) -> tuple[float, object]:
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn(*args)
    torch.cuda.synchronize()
    return time.perf_counter() - start, out


def workload_rows(path: str, args: argparse.Namespace) -> list[tuple[str, str, str]]:
    prompts = make_prompts(args.num_prompts, args.prompt_len, ONE_B_CONFIG["vocab_size"])
    rows, seconds = [], {}
    for name, factory in (
        ("Tandem", run_tandem),
        ("transformers static", run_hf_static),
        ("transformers generate_batch", run_hf_cb),
    ):
        generate = factory(path, args)
        generate(prompts[:8], 8)  # warm-up: compile, capture, allocate
        elapsed_s, outs = timed(generate, prompts, args.output_len)
        if any(len(o) != args.output_len for o in outs):
            raise RuntimeError(f"{name}: wrong output lengths")
        seconds[name] = elapsed_s
        tok_s = args.num_prompts * args.output_len / elapsed_s
        rows.append((f"workload: {name}", f"{tok_s:,.0f} tok/s, {elapsed_s:.2f} s", ""))
        del generate
        _release()
    ratio = seconds["transformers static"] / seconds["Tandem"]
    rows.append(("workload: Tandem vs transformers static", f"{ratio:.2f}x", "target >= 3x"))
    return rows


def _engine(
    path: str, max_num_seqs: int, max_tokens_per_step: int, args, async_scheduling=False
) -> object:
    from tandem.workers.config import EngineConfig
    from tandem.workers.engine.core import EngineCore

    return EngineCore(
        EngineConfig.from_flat(
            model=path,
            device="cuda",
            dtype="bfloat16",
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_tokens_per_step,
            enable_prefix_caching=False,
            gpu_memory_utilization=args.gpu_memory_utilization,
            async_scheduling=async_scheduling,
        )
    )


def model_bytes(engine) -> tuple[int, int]:
    """(weight bytes, KV bytes per token of context) of the engine's model."""
    weights = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    m = engine.model
    kv_per_token = m.num_layers * 2 * m.num_kv_heads * m.head_dim * engine.kv_cache.element_size()
    return weights, kv_per_token


def decode_rows(
    path: str, args: argparse.Namespace, hbm_tb_s: float, async_scheduling: bool = False
) -> list[tuple]:
    """Decode step time per batch; ``async_scheduling``: with the overlapped loop."""
    from tandem.wire.engine_protocol import EngineRequest, SamplingParams

    batches = [int(b) for b in args.decode_batches.split(",")]
    engine = _engine(path, max(batches), 8192, args, async_scheduling)
    loop = " (--async-scheduling)" if async_scheduling else ""
    weights, kv_per_token = model_bytes(engine)
    rows = []
    prompt = make_prompts(1, args.prompt_len, ONE_B_CONFIG["vocab_size"])[0]
    num_steps = args.decode_steps
    for batch in batches:
        params = SamplingParams(max_tokens=num_steps + 64, temperature=0.0, ignore_eos=True)
        ids = [f"b{batch}-{i}" for i in range(batch)]
        for rid in ids:
            engine.add_request(EngineRequest(rid, prompt, params))
        decoding = 0
        for _ in range(10_000):  # three decode-only steps in a row: every sequence decodes
            engine.step()
            decoding = decoding + 1 if engine.last_step_num_tokens == batch else 0
            if decoding == 3:
                break
        else:
            raise RuntimeError(f"batch {batch} never decoded whole (KV cache too small?)")
        elapsed_s, _ = timed(lambda: [engine.step() for _ in range(num_steps)])
        step_ms = elapsed_s / num_steps * 1e3
        context = args.prompt_len + num_steps // 2  # about the mean context while timed
        floor_ms = (weights + batch * context * kv_per_token) / (hbm_tb_s * 1e12) * 1e3
        rows.append(
            (
                f"decode step, batch {batch}{loop}",
                f"{step_ms:.2f} ms",
                f"floor {floor_ms:.2f} ms ({step_ms / floor_ms:.1f}x)",
            )
        )
        engine.abort(ids)
        while engine.has_work():
            engine.step()
        engine.check_integrity()
    graphs = engine.runner.graphs
    if graphs is not None and not async_scheduling:
        used = {size: n for size, n in graphs.num_replays.items() if n}
        rows.append(("decode graphs replayed (bucket: steps)", str(used), ""))
    return rows


def prefill_rows(path: str, args: argparse.Namespace) -> list[tuple]:
    from tandem.wire.engine_protocol import EngineRequest, SamplingParams

    length, count = args.prefill_len, args.prefill_prompts
    engine = _engine(path, count, length * count, args)
    prompts = make_prompts(count, length, ONE_B_CONFIG["vocab_size"])
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    def run(tag: str) -> None:
        for i, prompt in enumerate(prompts):
            engine.add_request(EngineRequest(f"{tag}-{i}", prompt, params))
        while engine.has_work():
            engine.step()

    run("warm")
    elapsed_s, _ = timed(run, "timed")
    engine.check_integrity()
    cfg = ONE_B_CONFIG
    hidden, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    head_dim = hidden // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * head_dim
    per_token_matmul = layers * (
        hidden * (hidden + 2 * kv) + hidden * hidden + 3 * hidden * cfg["intermediate_size"]
    )
    attention = layers * cfg["num_attention_heads"] * head_dim * length * (length + 1) // 2
    flops = count * (2 * length * per_token_matmul + 4 * attention)
    return [
        (
            f"prefill, {count} x {length} tokens",
            f"{flops / elapsed_s / 1e12:.0f} TFLOP/s",
            f"{elapsed_s * 1e3:.0f} ms",
        )
    ]


def compile_rows(path: str, args: argparse.Namespace) -> list[tuple]:
    """torch.compile vs eager (``--compile-model``): decode step at batch 64 (graphs replay
    either forward) and one prefill of ``--prefill-len`` tokens, with the compile time."""
    from benchmarks.compile_model import decode_step_ms, prefill_ms
    from tandem.workers.config import EngineConfig
    from tandem.workers.engine.core import EngineCore

    rows, batch = [], 64
    for mode in ("off", "on"):
        torch._dynamo.reset()
        engine = EngineCore(
            EngineConfig.from_flat(
                model=path, device="cuda", dtype="bfloat16", max_num_seqs=batch,
                max_num_batched_tokens=max(8192, args.prefill_len), enable_prefix_caching=False,
                gpu_memory_utilization=args.gpu_memory_utilization, compile_model=mode,
            )
        )  # fmt: skip
        name = "torch.compile" if mode == "on" else "eager"
        step_ms, _ = decode_step_ms(engine, batch, args.prompt_len, args.decode_steps, 3)
        note = f"compile {engine.compile_report.seconds:.0f} s" if mode == "on" else ""
        rows.append((f"decode step, batch {batch}, {name}", f"{step_ms:.2f} ms", note))
        one_prefill_ms = prefill_ms(engine, args.prefill_len, 3)
        rows.append((f"prefill 1 x {args.prefill_len}, {name}", f"{one_prefill_ms:.1f} ms", ""))
        engine.shutdown()
        del engine
        _release()
    return rows


def nixl_rows() -> list[tuple]:
    # NIXL VRAM READ (raw and through the connector, next to a device copy), measured by
    # ``benchmarks/gpu_nixl.py``'s ``vram_read_rows()``.
    try:
        from benchmarks.gpu_nixl import vram_read_rows  # type: ignore[import-not-found]
    except ImportError:
        return [("NIXL VRAM READ", "not measured", "benchmarks/gpu_nixl.py not present")]
    return list(vram_read_rows())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="64 x 128 -> 64, batches 1,64")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--decode-batches", default="1,64,256")
    p.add_argument("--decode-steps", type=int, default=50)
    p.add_argument("--prefill-len", type=int, default=2048)
    p.add_argument("--prefill-prompts", type=int, default=4)
    p.add_argument("--hbm-tb-s", type=float, default=None, help="HBM TB/s for the floor")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    p.add_argument(
        "--compile-rows", action="store_true", help="add torch.compile vs eager (minutes)"
    )
    p.add_argument(
        "--compile-only",
        action="store_true",
        help="only the torch.compile vs eager rows (gpu_session.sh extras)",
    )
    args = p.parse_args()
    message = no_gpu_message()
    if message is not None:
        print(message)
        return 0
    if args.quick:
        args.num_prompts, args.prompt_len, args.output_len = 64, 128, 64
        args.decode_batches, args.decode_steps = "1,64", 20
    args.device, args.dtype = "cuda", "bfloat16"  # read by the offline_throughput engines
    gpu = torch.cuda.get_device_name()
    hbm_tb_s = args.hbm_tb_s or next((v for k, v in HBM_TB_S.items() if k in gpu), 3.0)
    import transformers
    import triton

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    total_gib = torch.cuda.get_device_properties(0).total_memory / 2**30
    header = [
        f"GPU:      {gpu}, {total_gib:.0f} GiB; {datetime.date.today().isoformat()}",
        f"software: torch {torch.__version__}, triton {triton.__version__}, "
        f"transformers {transformers.__version__}",
        f"workload: random Llama-3.2-1B shape, bf16; {args.num_prompts} prompts x "
        f"{args.prompt_len} -> {args.output_len}, greedy, EOS ignored; seed {SEED}; "
        f"HBM floor at {hbm_tb_s} TB/s",
    ]
    print("\n".join(header), flush=True)
    rows: list[tuple] = []
    failed = False

    def section(fn, *fn_args, **fn_kwargs) -> None:
        """Measure one section; print its rows at once (a later failure or a session's time
        limit loses nothing already measured); a failure becomes a FAILED row."""
        nonlocal failed
        try:
            new = fn(*fn_args, **fn_kwargs)
        except Exception as exc:  # noqa: BLE001 - reported as a row, exit status 1
            traceback.print_exc()
            failed = True
            new = [(fn.__name__, "FAILED", f"{type(exc).__name__}: {exc}"[:300])]
        for row in new:
            print(f"  {row[0]:<48} {row[1]:>28}  {row[2]}", flush=True)
        rows.extend(new)
        _release()

    with tempfile.TemporaryDirectory(prefix="tandem-gpu-bench-") as tmp_dir:
        path = make_1b_checkpoint(tmp_dir)
        if not args.compile_only:
            section(workload_rows, path, args)
            section(decode_rows, path, args, hbm_tb_s)
            section(decode_rows, path, args, hbm_tb_s, async_scheduling=True)
            section(prefill_rows, path, args)
        if args.compile_rows or args.compile_only:
            section(compile_rows, path, args)
    if not args.compile_only:
        section(nixl_rows)

    print()
    print("\n".join(header))
    width = max(len(r[0]) for r in rows)
    print(f"{'measure':<{width}}  {'value':>28}  note")
    print("-" * (width + 50))
    for name, value, note in rows:
        print(f"{name:<{width}}  {value:>28}  {note}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
