"""Offline throughput: Tandem's ``LLM.generate`` vs transformers on the same weights.

    .venv/bin/python benchmarks/offline_throughput.py            # 64 x 128 -> 128, tiny + medium
    .venv/bin/python benchmarks/offline_throughput.py --models tiny --engines tandem

Every engine gets the same seeded random prompts, generates exactly ``--output-len`` tokens per
prompt (greedy, EOS ignored, fp32) after a warm-up run, and is timed end to end (prefill and
decode). Engines:

    tandem      LLM(EngineConfig.from_flat(...)).generate(prompt_token_ids=..., SamplingParams(...))
    hf-cb       transformers' continuous batching, ``model.generate_batch`` (paged cache; pages
                of 256 tokens, just enough of them, the same token budget per step as tandem)
    hf-static   transformers' ``model.generate`` on one static batch of all prompts

Models: ``tiny`` (the built-in checkpoint), ``medium``, a random Llama (hidden 512, 8 layers,
8 heads, 2 KV heads, vocab 32000) built with transformers and saved to a temporary directory,
and ``smollm2`` (``--models smollm2``: SmolLM2-135M-Instruct, 30 layers, from the built-in GGUF;
every engine loads the cached fp32 directory it converts to, so the weights are the same).
"match" is the fraction of prompts whose tokens equal hf-static's (near-ties in random models
may legitimately flip a few under different batch shapes). "cpu s" is the process CPU time of
the timed run: with one thread, close to "time s" unless other processes took the core.

Threads: on a 2-core machine shared with other jobs, one torch thread is the robust choice.
Two OpenMP threads win only on an idle machine (1.3x tiny, 1.75x medium here); when the other
core is busy, every parallel region waits for a descheduled thread (10-25x slower measured).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._machine import machine  # noqa: E402

MEDIUM_CONFIG = {
    "vocab_size": 32000,
    "hidden_size": 512,
    "intermediate_size": 1536,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "initializer_range": 0.05,  # large enough that greedy decoding does not collapse
    "tie_word_embeddings": False,
}
SEED = 0

Tokens = list[list[int]]


def model_path(name: str, tmp_dir: str) -> str:
    """Directory of ``tiny``, ``smollm2`` or the random ``medium`` (written once to tmp_dir)."""
    if name == "tiny":
        from tandem.workers.checkpoints.tiny import ensure_tiny_model

        return ensure_tiny_model()
    if name == "smollm2":  # the GGUF's converted fp32 directory: both sides load the same weights
        from tandem.workers.checkpoints.loader import resolve_model_path

        return resolve_model_path("smollm2")
    if name != "medium":
        raise ValueError(f"unknown model {name!r} (tiny, medium or smollm2)")
    from transformers import LlamaConfig, LlamaForCausalLM

    path = os.path.join(tmp_dir, "medium")
    torch.manual_seed(SEED)
    config = LlamaConfig(**MEDIUM_CONFIG, eos_token_id=2, bos_token_id=1, pad_token_id=0)
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def make_prompts(num_prompts: int, prompt_len: int, vocab_size: int) -> Tokens:
    g = torch.Generator().manual_seed(SEED)
    return torch.randint(3, vocab_size, (num_prompts, prompt_len), generator=g).tolist()


def _device_dtype(args: argparse.Namespace) -> tuple[str, str]:
    """``args.device`` / ``args.dtype`` when a caller sets them (benchmarks/gpu_engine.py);
    this script always runs fp32 on the CPU."""
    return getattr(args, "device", "cpu"), getattr(args, "dtype", "float32")


def run_tandem(path: str, args: argparse.Namespace) -> Callable[[Tokens, int], Tokens]:
    from tandem.wire.engine_protocol import SamplingParams
    from tandem.workers.config import EngineConfig
    from tandem.workers.engine.llm import LLM

    blocks_per_seq = -(-(args.prompt_len + args.output_len) // 16)
    device, dtype = _device_dtype(args)
    llm = LLM(
        EngineConfig.from_flat(
            model=path,
            device=device,
            dtype=dtype,
            max_num_seqs=args.num_prompts,
            max_num_batched_tokens=args.max_num_batched_tokens,
            num_kv_blocks=args.num_prompts * blocks_per_seq + 16,
            enable_prefix_caching=False,
        )
    )

    def generate(prompts: Tokens, output_len: int) -> Tokens:
        sp = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
        return [r.token_ids for r in llm.generate(prompt_token_ids=prompts, sampling_params=sp)]

    return generate


def _load_hf(path: str, args: argparse.Namespace):
    from transformers import AutoModelForCausalLM

    device, dtype = _device_dtype(args)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    model = model.to(device).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def run_hf_static(path: str, args: argparse.Namespace) -> Callable[[Tokens, int], Tokens]:
    model = _load_hf(path, args)

    def generate(prompts: Tokens, output_len: int) -> Tokens:
        ids = torch.tensor(prompts, device=model.device)  # equal lengths: no padding
        with torch.inference_mode():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=output_len,
                min_new_tokens=output_len,
            )
        return out[:, ids.shape[1] :].tolist()

    return generate


def run_hf_cb(path: str, args: argparse.Namespace) -> Callable[[Tokens, int], Tokens]:
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.CRITICAL)  # psutil nags
    model = _load_hf(path, args)
    page_size = 256
    pages_per_seq = -(-(args.prompt_len + args.output_len) // page_size)
    # transformers 5.17 (the GPU image's) names the page size block_size; later ones page_size
    fields = ContinuousBatchingConfig.__dataclass_fields__
    size_field = "page_size" if "page_size" in fields else "block_size"
    cb_config = ContinuousBatchingConfig(
        **{size_field: page_size},
        num_blocks=args.num_prompts * pages_per_seq + 4,
        max_batch_tokens=args.max_num_batched_tokens,
        max_requests_per_batch=args.num_prompts,
        allow_block_sharing=False,
    )

    def generate(prompts: Tokens, output_len: int) -> Tokens:
        gen_config = GenerationConfig(
            max_new_tokens=output_len, do_sample=False, eos_token_id=-1, pad_token_id=0
        )
        # The manager persists across calls, so the timed run reuses the warmed-up one.
        results = model.generate_batch(
            prompts,
            generation_config=gen_config,
            continuous_batching_config=cb_config,
            persistent_manager=True,
        )
        outs = list(results.values())
        if len(outs) != len(prompts) or any(o.error for o in outs):
            raise RuntimeError(f"generate_batch failed: {[o.error for o in outs if o.error]}")
        return [list(o.generated_tokens) for o in outs]

    return generate


ENGINES = {"tandem": run_tandem, "hf-cb": run_hf_cb, "hf-static": run_hf_static}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--models", default="tiny,medium")
    p.add_argument("--engines", default="tandem,hf-cb,hf-static")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch.set_num_threads (1: best on a shared 2-core box, see the module docstring)",
    )
    p.add_argument("--repeats", type=int, default=1, help="timed runs per engine; best is kept")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    import transformers
    from transformers import AutoConfig

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()

    engines = args.engines.split(",")
    rows = []
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="tandem-bench-") as tmp_dir:
        for name in args.models.split(","):
            path = model_path(name, tmp_dir)
            vocab = AutoConfig.from_pretrained(path).vocab_size
            prompts = make_prompts(args.num_prompts, args.prompt_len, vocab)
            reference: Tokens | None = None
            results: dict[str, tuple[float, float, Tokens]] = {}  # wall s, cpu s, outputs
            for engine in engines:
                generate = ENGINES[engine](path, args)
                generate(prompts[: min(8, len(prompts))], 8)  # warm-up
                best = None
                for _ in range(args.repeats):
                    start_s, start_cpu_s = time.perf_counter(), time.process_time()
                    outs = generate(prompts, args.output_len)
                    elapsed_s = time.perf_counter() - start_s
                    cpu_s = time.process_time() - start_cpu_s
                    if any(len(o) != args.output_len for o in outs):
                        raise RuntimeError(f"{engine}: wrong output lengths")
                    if best is None or elapsed_s < best[0]:
                        best = (elapsed_s, cpu_s, outs)
                results[engine] = best
                if engine == "hf-static":
                    reference = best[2]
                del generate
            num_tokens = args.num_prompts * args.output_len
            base = results["hf-cb"][0] if "hf-cb" in results else None
            for engine, (elapsed_s, cpu_s, outs) in results.items():
                match = "-"
                if reference is not None:
                    match = f"{sum(a == b for a, b in zip(outs, reference)) / len(outs):.2f}"
                speedup = f"{base / elapsed_s:.2f}x" if base else "-"
                rows.append(
                    (name, engine, num_tokens / elapsed_s, elapsed_s, cpu_s, speedup, match)
                )
    load_after = os.getloadavg()

    print(f"machine:  {machine()}")
    print(
        f"workload: {args.num_prompts} prompts x {args.prompt_len} tokens -> {args.output_len} "
        f"new tokens each; greedy, EOS ignored, fp32; seed {SEED}; torch threads "
        f"{args.threads}; budget {args.max_num_batched_tokens} tokens/step; "
        f"best of {args.repeats}"
    )
    print(
        f"load avg: {load_before[0]:.2f} before, {load_after[0]:.2f} after "
        f"(1-min); torch {torch.__version__}"
    )
    header = (
        f"{'model':<8} {'engine':<10} {'tok/s':>9} {'time s':>8} {'cpu s':>8} {'vs hf-cb':>9} "
        f"{'match':>6}"
    )
    print(header)
    print("-" * len(header))
    for name, engine, tps, elapsed_s, cpu_s, speedup, match in rows:
        print(
            f"{name:<8} {engine:<10} {tps:>9.1f} {elapsed_s:>8.2f} {cpu_s:>8.2f} {speedup:>9} "
            f"{match:>6}"
        )


if __name__ == "__main__":
    main()
