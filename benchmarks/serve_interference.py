"""Interference: decode ITL while long prompts arrive, 1P+1D vs 2 colocated.

Both setups run the same random Llama checkpoint (sizes in MODEL, the
`tiny` byte tokenizer) on the same cores (2 engines, one torch thread each)
under the same load (DECODES + LONGS), driven by two `tandem bench`
processes: steady decode streams with short prompts,
and long prompts arriving as a Poisson process.

Reported: ITL and TPOT of the steady decodes, TTFT of the long prompts.
Target: disaggregated decode ITL p99 at most half the colocated one.

Run: python benchmarks/serve_interference.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._machine import machine  # noqa: E402
from cluster.serve import SERVE_DEFAULTS, ServiceThread  # noqa: E402

ENGINE = {
    "num_kv_blocks": 512,
    "max_num_seqs": 64,
    "max_model_len": 2048,
    "max_num_batched_tokens": 2048,
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
DECODES = dict(num_requests=8, concurrency=4, input_len=32, output_len=128)
LONGS = dict(num_requests=16, request_rate=2.0, input_len=1536, output_len=2)


def _bench(url: str, seed: int, spec: dict) -> subprocess.Popen:
    """`tandem bench` in its own process (the gateway's process stays the gateway's)."""
    args = [sys.executable, "-m", "cluster", "bench", "--url", url, "--seed", str(seed), "--json"]
    for key, value in spec.items():
        args += ["--" + key.replace("_", "-"), str(value)]
    return subprocess.Popen(args, stdout=subprocess.PIPE, text=True)


def _load(url: str, seed: int) -> tuple[dict, dict]:
    procs = [_bench(url, seed, DECODES), _bench(url, seed + 1, LONGS)]
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

    from workers.tiny import ensure_tiny_model

    tiny = ensure_tiny_model()
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=262, max_position_embeddings=4096, bos_token_id=256, eos_token_id=257, **MODEL
    )
    transformers.LlamaForCausalLM(cfg).save_pretrained(out_dir)
    for name in os.listdir(tiny):
        if "token" in name or name == "chat_template.jinja":
            shutil.copy(os.path.join(tiny, name), out_dir)
    return out_dir


def run_setup(pools: dict, model: str) -> tuple[dict, dict]:
    settings = dict(SERVE_DEFAULTS, ray_dashboard=False, model=model, **pools)
    per_role = {r: dict(ENGINE) for r in ("prefill", "decode", "colocated")}
    with ServiceThread(settings, per_role) as svc:
        _load(svc.base_url, seed=100)  # warm-up (handshakes, caches)
        return _load(svc.base_url, seed=0)


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
        f"workload: random Llama {MODEL}, fp32; decodes {DECODES}; long prompts {LONGS}; "
        "2 engines, 1 torch thread each"
    )
    hdr = (
        "| setup | decode ITL p50 ms | decode ITL p99 ms | decode TPOT mean ms "
        "| long-prompt TTFT p50 ms | long-prompt TTFT p99 ms | decode tok/s |"
    )
    print(hdr)
    print("|" + "|".join("---" for _ in hdr.split("|")[1:-1]) + "|")
    for name, d, lg in rows:
        print(
            f"| {name} | {d['itl_ms']['p50']:.1f} | {d['itl_ms']['p99']:.1f} "
            f"| {d['tpot_ms']['mean']:.1f} | {lg['ttft_ms']['p50']:.0f} "
            f"| {lg['ttft_ms']['p99']:.0f} | {d['output_token_throughput']:.0f} |"
        )
    ratio = rows[0][1]["itl_ms"]["p99"] / rows[1][1]["itl_ms"]["p99"]
    print(f"disaggregated / colocated decode ITL p99: {ratio:.2f} (target <= 0.5)")


if __name__ == "__main__":
    main()
