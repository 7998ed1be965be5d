"""Interference: decode ITL while long prompts arrive, 1P+1D vs 2 colocated.

Both setups run the same random Llama checkpoint (sizes in MODEL, the
`tiny` byte tokenizer) on the same cores (2 engines, one torch thread each)
under the same load, driven by two `tandem bench` processes:

- DECODES: steady decode streams (short prompts, long outputs) that run for
  the whole measurement;
- LONGS: long prompts arriving as a Poisson process, started LONG_START_S
  after the decodes so every long prompt lands on decodes in steady state.

The engines chunk prefills at 512 tokens (ENGINE), the usual colocated
setting for bounding one prefill step. Reported: ITL percentiles and TPOT of
the steady decodes (client side, one SSE chunk per token), TTFT of the long
prompts. Target: disaggregated decode ITL p99 at most half the colocated one.

Run: python benchmarks/serve_interference.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._machine import machine  # noqa: E402
from tandem.cluster.cli.serve import ServiceThread  # noqa: E402
from tandem.cluster.cli.settings import serve_config  # noqa: E402

ENGINE = {
    "num_kv_blocks": 512,
    "max_num_seqs": 64,
    "max_model_len": 2048,
    "max_num_batched_tokens": 512,
}
SETUPS = {
    "1 prefill + 1 decode": dict(prefill=1, decode=1, colocated=0),
    "2 colocated": dict(prefill=0, decode=0, colocated=2),
}


MODEL = dict(
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
)
# 8 streams x 3 requests x 512 tokens: about as long as the long-prompt arrivals.
DECODES = dict(num_requests=24, concurrency=8, input_len=32, output_len=512)
LONGS = dict(num_requests=24, request_rate=3.0, input_len=1536, output_len=2)
LONG_START_S = 1.0
# Handshakes, first allocations and the dense decode rows before measuring.
WARMUP = (
    dict(num_requests=8, concurrency=8, input_len=32, output_len=32),
    dict(num_requests=2, request_rate=3.0, input_len=1536, output_len=2),
)


def _bench(url: str, seed: int, spec: dict) -> subprocess.Popen:
    """`tandem bench` in its own process (the gateway's process stays the gateway's)."""
    args = [
        sys.executable,
        "-m",
        "tandem.cluster",
        "bench",
        "--url",
        url,
        "--seed",
        str(seed),
        "--json",
    ]
    for key, value in spec.items():
        args += ["--" + key.replace("_", "-"), str(value)]
    return subprocess.Popen(args, stdout=subprocess.PIPE, text=True)


def _load(url: str, seed: int, decodes: dict, longs: dict, long_start_s: float):
    procs = [_bench(url, seed, decodes)]
    time.sleep(long_start_s)
    procs.append(_bench(url, seed + 1, longs))
    out = []
    for p in procs:
        stdout, _ = p.communicate(timeout=600)
        out.append(json.loads(stdout))
    return out[0], out[1]


def make_checkpoint(out_dir: str) -> str:
    """A random Llama big enough that a long prefill costs many decode steps."""
    import shutil

    import torch
    import transformers

    from tandem.workers.checkpoints.tiny import ensure_tiny_model

    tiny = ensure_tiny_model()
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=262, max_position_embeddings=4096, bos_token_id=256, eos_token_id=257, **MODEL
    )
    model = transformers.LlamaForCausalLM(cfg)
    # Random weights over a byte tokenizer emit random bytes, and a run of bytes >= 0x80
    # is held back by the detokenizer as a possibly incomplete UTF-8 character (up to
    # 16 tokens): the client would see one chunk for many tokens, and ITL would measure
    # that. Zero logits for every non-ASCII token make the greedy pick ASCII (some ASCII
    # logit is positive), so each token is one text chunk, as with a real model. Same
    # shapes, same compute.
    with torch.no_grad():
        model.lm_head.weight[128:] = 0.0
    model.save_pretrained(out_dir)
    for name in os.listdir(tiny):
        if "token" in name or name == "chat_template.jinja":
            shutil.copy(os.path.join(tiny, name), out_dir)
    return out_dir


def run_setup(pools: dict, model: str) -> tuple[dict, dict]:
    config = serve_config(ray_dashboard=False, model=model, **pools, **ENGINE)
    with ServiceThread(config) as svc:
        _load(svc.base_url, 100, *WARMUP, long_start_s=0.0)
        return _load(svc.base_url, 0, DECODES, LONGS, LONG_START_S)


def main() -> None:
    import tempfile

    import ray

    ray.init(include_dashboard=False, log_to_driver=False)
    rows = []
    model = make_checkpoint(tempfile.mkdtemp(prefix="tandem-bench-"))
    try:
        for name, pools in SETUPS.items():
            d, lg = run_setup(pools, model)
            assert d["num_failed"] == 0 and lg["num_failed"] == 0, (d["errors"], lg["errors"])
            rows.append((name, d, lg))
    finally:
        ray.shutdown()
    print(f"machine: {machine()}")
    print(
        f"workload: random Llama {MODEL} (ASCII output), fp32; decodes {DECODES}; "
        f"long prompts {LONGS} from {LONG_START_S:g} s; engines {ENGINE}, 1 torch thread each"
    )
    hdr = (
        "| setup | decode ITL p50 | p90 | p99 | p99.9 | max | TPOT mean "
        "| long-prompt TTFT p50 | TTFT p99 | decode tok/s |"
    )
    print(hdr)
    print("|---|" + "---:|" * (len(hdr.split("|")) - 3))
    for name, d, lg in rows:
        itl = d["itl_ms"]
        print(
            f"| {name} | {itl['p50']:.1f} ms | {itl['p90']:.1f} ms | {itl['p99']:.1f} ms "
            f"| {itl['p99.9']:.1f} ms | {itl['max']:.1f} ms | {d['tpot_ms']['mean']:.1f} ms "
            f"| {lg['ttft_ms']['p50']:.0f} ms | {lg['ttft_ms']['p99']:.0f} ms "
            f"| {d['output_token_throughput']:.0f} |"
        )
    ratio = rows[0][1]["itl_ms"]["p99"] / rows[1][1]["itl_ms"]["p99"]
    print(f"disaggregated / colocated decode ITL p99: {ratio:.2f} (target <= 0.5)")


if __name__ == "__main__":
    main()
