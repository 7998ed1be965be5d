"""KV tiers below the device cache (kvtransfer/tiers/): copy speed, a multi-turn
trace, and what an idle tier costs a step.

    python benchmarks/kv_tiers.py            (about 2-3 minutes on the 2-core CPU box)
    python benchmarks/kv_tiers.py --parts trace --tp 2   (the trace, TP=2 engines)

1. Store and load GB/s per tier through ``TierStore`` (the tier thread, checksums
   included) next to its ceilings, measured in the same rounds (benchmarks/_tier_copies.py
   says which): plain copies of the same bytes in one process (host: all at once, one
   thread block by block, two threads, one thread with each block's checksum); the
   disk's sequential read of one file of the same size with its pages dropped from the
   page cache (disk; the tier's loads also read cold files). One disk row per
   ``--disk-readers`` count (threads reading a load's blocks at once; 1: one by one
   on the tier thread); each disk row also loads the same blocks again with their
   files in the page cache (the tier's own cost without the device's). With
   ``--repeats N`` every figure is the median of N rounds (the box is shared).
2. A multi-turn trace (``cluster/cli/trace_replay.synthesize``: sessions that grow
   turn by turn over shared system prompts and documents) replayed one request at a
   time through a model (``--model``, tiny by default) in fp32, with a device cache of about a quarter of the trace's
   distinct blocks: hit rate, TTFT p50/p99 and prefill tokens computed for
   device-only, +host, +host+disk, and +host storing on eviction instead of
   write-through.
3. Decode step time with the host tier on but idle against off.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks._tier_copies import copy_part  # noqa: E402
from tandem.cluster.cli.trace_replay import SynthConfig, TraceRequest, synthesize, synthesize_prompt  # noqa: E402
from tandem.wire.engine_protocol import EngineRequest, SamplingParams  # noqa: E402
from tandem.workers.config import EngineConfig  # noqa: E402
from tandem.workers.engine.core import EngineCore  # noqa: E402

GIB = 1 << 30


# ---- 2. multi-turn trace ------------------------------------------------------------------


def trace_prompts(vocab: int) -> list[tuple[list[int], int]]:
    cfg = SynthConfig(
        num_sessions=12,
        turns_per_session=(3, 5),
        num_system_prompts=2,
        system_prompt_blocks=4,
        num_documents=10,
        document_blocks=8,
        question_blocks=(1, 2),
        answer_tokens=(8, 16),
        block_tokens=16,
        seed=1,
    )
    rows = synthesize(cfg)
    out = []
    for i, r in enumerate(rows):
        req = TraceRequest(
            r["timestamp"] / 1000, r["input_length"], r["output_length"], r["hash_ids"]
        )
        out.append((synthesize_prompt(req, i, vocab, 0, 16), r["output_length"]))
    return out


def replay(engine: EngineCore, trace: list[tuple[list[int], int]], max_tokens: int) -> dict:
    ttfts, computed, prompt_total, cached_total = [], 0, 0, 0
    for i, (prompt, _) in enumerate(trace):
        sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        start = time.perf_counter()
        assert engine.add_request(EngineRequest(f"t{i}", prompt, sp)) is None
        first, cached, wait_ms = None, 0, 0
        while engine.has_work():
            for o in engine.step().outputs:
                if o.new_token_ids and first is None:
                    first = time.perf_counter() - start
                    cached = o.num_cached_tokens
            # as the service loop waits (workers/engine/loop_wait.py): nothing computed
            # while KV loads -> 1, 2, 4, 8 ms
            wait_ms = 0 if engine.last_step_num_tokens else min(max(2 * wait_ms, 1), 8)
            if wait_ms:
                time.sleep(wait_ms / 1000)
        store = getattr(engine.connector_worker, "store", None)
        if store is not None:
            store.flush(60)  # between requests, as a think time would
        ttfts.append(first)
        prompt_total += len(prompt)
        cached_total += cached
        computed += len(prompt) - cached
    engine.check_integrity()
    ttfts.sort()
    return {
        "hit": cached_total / prompt_total,
        "p50": statistics.median(ttfts),
        "p99": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
        "computed": computed,
    }


def _in_child(part: str, args: argparse.Namespace) -> list:
    """Run one configuration in a fresh process: in one process, every engine after the
    first stepped several times slower on the CPU box, tiers or not."""
    import json
    import subprocess

    out = []
    block_bytes = _block_bytes(args.model) // args.tp if part == "trace" else 0
    # the step configurations alternate, three times each (the box's load drifts)
    order = {"trace": range(len(TRACE_CONFIGS)), "step": [0, 1] * 3, "churn": [2, 3, 4] * 3}[part]
    for index in order:
        cmd = [sys.executable, __file__, "--one", f"{part}:{index}:{block_bytes}",
               "--model", args.model, "--steps", str(args.steps),
               "--threads", str(args.threads), "--tp", str(args.tp)]  # fmt: skip
        res = subprocess.run(cmd, capture_output=True, text=True, check=True)
        out.append(json.loads(res.stdout.strip().splitlines()[-1]))
    return out


TRACE_CONFIGS = ("device only", "+host (write-through)", "+host (write on eviction)", "+host+disk")


def _block_bytes(model: str) -> int:
    """Bytes of one fp32 KV block of ``model``, from its config (no engine: the first
    engine of a process is the one measured)."""
    from tandem.workers.engine.startup import load_engine_model

    loaded = load_engine_model(EngineConfig.from_flat(model=model, dtype="float32"))
    m = loaded.model
    return m.num_layers * 2 * 16 * m.num_kv_heads * m.head_dim * 4


def trace_one(tmp: str, model: str, index: int, block_bytes: int, tp: int = 1) -> dict:
    """``block_bytes``: of one rank's shard; with ``tp`` > 1 every rank's tier is as large
    (kvtransfer/tiers/ranks.py)."""
    base = dict(model=model, dtype="float32", max_model_len=512, max_num_batched_tokens=512)
    if tp > 1:
        base.update(tensor_parallel_size=tp, torch_threads=1)
    trace = trace_prompts(256)  # token ids every model here has
    distinct = len({tuple(p[: (k + 1) * 16]) for p, _ in trace for k in range(len(p) // 16)})
    device_blocks = max(distinct // 4, 40)
    host = device_blocks * block_bytes / GIB  # as large as the device cache
    configs = [
        ("device only", {}),
        ("+host (write-through)", {"kv_offloading_size": 2 * host}),
        ("+host (write on eviction)", {"kv_offloading_size": 2 * host,
                                       "extra": {"kv_tiers": {"store_policy": "eviction"}}}),
        ("+host+disk", {"kv_offloading_size": host, "kv_offloading_disk_dir": tmp,
                        "kv_offloading_disk_size": 8 * host}),
    ]  # fmt: skip
    name, extra = configs[index]
    engine = EngineCore(EngineConfig.from_flat(**base, num_kv_blocks=device_blocks, **extra))
    replay(engine, trace[:3], 1)  # warm-up (fresh prompts: ids t0.. are reused below)
    engine.scheduler.reset_prefix_cache()
    store = getattr(engine.connector_worker, "store", None)
    r = replay(engine, trace, 2)
    r["stored"] = store.stats().get("host_stored_bytes", 0) / 1e6 if store else 0.0
    engine.shutdown()
    return dict(r, name=name, device_blocks=device_blocks, distinct=distinct)


# ---- 3. idle tier step cost ---------------------------------------------------------------


STEP_CONFIGS = (
    ("tiers off", {}),
    ("host tier on, no loads", {"kv_offloading_size": 0.25}),
    ("churn: tiers off", {}),
    ("churn: host, write-through", {"kv_offloading_size": 0.25}),
    ("churn: host, write on eviction",
     {"kv_offloading_size": 0.25, "extra": {"kv_tiers": {"store_policy": "eviction"}}}),
)  # fmt: skip


def step_one(num_steps: int, model: str, index: int) -> dict:
    """Median step time. 0-1: 8 requests decoding. 2-4 (churn): a small device cache
    and a stream of new prompts, so every admission evicts cached blocks (what a
    write-on-eviction store must copy on the step's path)."""
    name, extra = STEP_CONFIGS[index]
    churn = index >= 2
    engine = EngineCore(
        EngineConfig.from_flat(
            model=model, dtype="float32", num_kv_blocks=40 if churn else 256, **extra
        )
    )
    n = 0

    def add(tokens: int, max_tokens: int) -> None:
        nonlocal n
        sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        prompt = [(n * 31 + j * 7) % 250 + 1 for j in range(tokens)]
        assert engine.add_request(EngineRequest(f"d{n}", prompt, sp)) is None
        n += 1

    spent = [0.0]  # seconds inside the tiers' per-step calls on the loop thread
    if engine.connector_worker is not None:
        for obj, names in (
            (engine.connector_scheduler, ("build_connector_meta", "get_num_new_matched_tokens",
                                          "update_connector_output")),
            (engine.connector_worker, ("start_load_kv", "get_finished")),
            (engine.scheduler.kv.pool.events, ("stored", "removed")),
        ):  # fmt: skip
            for attr in names:
                setattr(obj, attr, _timed(getattr(obj, attr), spent))
    for _ in range(8):
        add(96 if churn else 40, 6 if churn else num_steps + 20)
    for _ in range(10):  # prefill and warm-up
        engine.step()
    times = []
    spent[0] = 0.0
    for _ in range(num_steps):
        if churn and len(engine.scheduler.running) + len(engine.scheduler.waiting) < 8:
            add(96, 6)
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    engine.abort([f"d{i}" for i in range(n)])
    while engine.has_work():
        engine.step()
    engine.shutdown()
    return {"name": name, "ms": statistics.median(times) * 1000,
            "tier_us": spent[0] / num_steps * 1e6}  # fmt: skip


def _timed(fn, spent: list[float]):
    def wrapper(*a, **kw):
        t = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            spent[0] += time.perf_counter() - t

    return wrapper


def print_trace(trace_rows: list[dict], model: str) -> None:
    device_blocks, distinct = trace_rows[0]["device_blocks"], trace_rows[0]["distinct"]
    print(
        f"\n2. multi-turn trace, {model} fp32, TP={trace_rows[0].get('tp', 1)}, "
        f"device cache {device_blocks} blocks, "
        f"{distinct} distinct blocks in the trace"
    )
    print(
        "| tiers | hit rate | TTFT p50 (ms) | TTFT p99 (ms) | prefill tokens computed | MB stored to host |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for r in trace_rows:
        name = r["name"]
        print(
            f"| {name} | {r['hit']:.1%} | {r['p50'] * 1000:.0f} | {r['p99'] * 1000:.0f} | "
            f"{r['computed']} | {r['stored']:.0f} |"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=512, help="blocks per copy test")
    ap.add_argument("--block-kib", type=int, default=256)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--device", default="cpu", help="cpu | cuda (copy speeds only on cuda)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--disk-readers",
        default="1,4",
        help='disk rows: reader threads per load (1: one by one; "": no disk rows)',
    )
    ap.add_argument(
        "--repeats", type=int, default=1, help="copy part: disk rounds per row (medians)"
    )
    ap.add_argument("--parts", default="copy,trace,churn,step")
    ap.add_argument("--model", default="tiny", help="trace and step model (tiny, smollm2, ...)")
    ap.add_argument("--tp", type=int, default=1, help="trace part: tensor_parallel_size")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # PART:INDEX, in a child process
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.one:
        import json

        part, index, block_bytes = args.one.split(":")
        if part == "trace":
            with tempfile.TemporaryDirectory() as tmp:
                row = trace_one(tmp, args.model, int(index), int(block_bytes), args.tp)
                print(json.dumps(row | {"tp": args.tp}))
        else:  # step, churn
            print(json.dumps(step_one(args.steps, args.model, int(index))))
        return 0
    parts = args.parts.split(",")
    if "copy" in parts:
        with tempfile.TemporaryDirectory() as tmp:
            readers = tuple(int(n) for n in args.disk_readers.split(",") if n)  # "": none
            copy_part(args.blocks, args.block_kib * 1024, tmp, args.device, readers, args.repeats)
    if "trace" in parts:
        print_trace(_in_child("trace", args), args.model)
    if "churn" in parts:
        runs = _in_child("churn", args)
        print(f"\n3b. steps that evict cached blocks, {args.model} fp32 (ms: best of 3 medians)")
        print("| store policy | step |\n| --- | --- |")
        for name in dict.fromkeys(r["name"] for r in runs):
            print(f"| {name} | {min(r['ms'] for r in runs if r['name'] == name):.2f} |")
    if "step" not in parts:
        return 0
    runs = _in_child("step", args)
    steps = [
        (n, min(r["ms"] for r in runs if r["name"] == n))
        for n in dict.fromkeys(r["name"] for r in runs)
    ]
    tier_us = min(r["tier_us"] for r in runs if r["name"] == steps[1][0])
    print(f"\n3. decode step, 8 requests, {args.model} fp32 (ms: best of 3 processes' medians)")
    print("| tiers | step |\n| --- | --- |")
    for name, ms in steps:
        print(f"| {name} | {ms:.2f} |")
    off, on = steps[0][1], steps[1][1]
    print(
        f"idle tier cost: {100 * (on - off) / off:+.1f}% of a step; the tiers' own calls on "
        f"the loop thread: {tier_us:.0f} us a step ({tier_us / 10 / off:.2f}% of the off step)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
