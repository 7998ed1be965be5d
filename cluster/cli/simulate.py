"""``tandem profile``, ``tandem simulate`` and ``tandem plan``: the CLI of
cluster/planner/ (profile, simulator, xPyD search).

The workload is what ``tandem bench`` would send: a trace (``--trace``,
Mooncake JSONL or Azure CSV, read by cluster/cli/trace_replay.py, a
synthetic Mooncake trace from ``python -m tandem.cluster.cli.trace_replay``
included) or, without one, ``--num-requests`` random prompts of
``--input-len``/``--output-len`` tokens arriving at ``--request-rate``
(Poisson), seeded by ``--seed``."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from tandem.cluster.cli.trace_replay import add_trace_arguments

VOCAB_SIZE = 32000  # prompts are token ids for the schedulers' prefix cache only
# tandem profile: the engine settings a profile must share with the engines it
# models (the step costs and the scheduler limits the simulator takes)
ENGINE_LIMITS = {
    "tensor_parallel_size": "workers per engine (the profile's engine shape)",
    "torch_threads": "CPU torch threads of the engine",
    "num_kv_blocks": "KV cache blocks",
    "block_size": "tokens per KV block",
    "max_num_seqs": "requests per step at most",
    "max_num_batched_tokens": "tokens per step at most",
    "max_model_len": "prompt + output tokens at most",
}


def _add_workload(p: argparse.ArgumentParser) -> None:
    add_trace_arguments(p)
    p.add_argument("--num-requests", type=int, default=200, help="without --trace")
    p.add_argument("--request-rate", type=float, default=4.0, help="requests/s, without --trace")
    p.add_argument("--input-len", type=int, default=512, help="without --trace")
    p.add_argument("--output-len", type=int, default=128, help="without --trace")
    p.add_argument("--range-ratio", type=float, default=0.0, help="without --trace")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ttft-slo-ms", type=float, default=None)
    p.add_argument(
        "--itl-slo-ms",
        type=float,
        default=None,
        help="SLO on each request's mean inter-token time (TPOT)",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def load_workload(args: argparse.Namespace) -> list[Any]:
    """``SimRequest``s of the trace or the synthetic workload; ValueError naming the flag."""
    from tandem.cluster.cli import bench
    from tandem.cluster.cli.trace_replay import trace_workload
    from tandem.cluster.planner.simulator import SimRequest

    if args.trace is not None:
        try:
            prompts, outs, offsets = trace_workload(
                args.trace, VOCAB_SIZE, args.seed, args.time_scale, args.trace_block_tokens
            )
        except OSError as exc:
            raise ValueError(f"--trace {args.trace}: {exc.strerror}") from None
    else:
        if args.request_rate is None or args.request_rate <= 0:
            raise ValueError("--request-rate must be > 0")
        cfg = bench.BenchConfig(
            url="",
            num_requests=args.num_requests,
            request_rate=args.request_rate,
            input_len=args.input_len,
            output_len=args.output_len,
            range_ratio=args.range_ratio,
            seed=args.seed,
        )
        cfg.validate()
        prompts, outs, offsets = bench.build_workload(cfg, VOCAB_SIZE)
    return [SimRequest(t, p, o) for p, o, t in zip(prompts, outs, offsets)]


def _check_slos(args: argparse.Namespace, required: bool) -> None:
    for name in ("ttft_slo_ms", "itl_slo_ms"):
        flag = "--" + name.replace("_", "-")
        v = getattr(args, name)
        if v is None and required:
            raise ValueError(f"{flag} is required")
        if v is not None and not v > 0:
            raise ValueError(f"{flag} must be > 0, got {v}")


def _profile(args: argparse.Namespace):
    from tandem.cluster.planner.profile import load_profile

    if not args.profile:
        raise ValueError("--profile is required (tandem profile --out FILE writes one)")
    return load_profile(args.profile)


def _profiles_by_tp(paths: list[str] | None) -> dict[int, Any]:
    """``tandem plan``'s ``--profile`` files by tensor-parallel size: one
    each, all of one model. ValueError naming the flag."""
    from tandem.cluster.planner.profile import load_profile

    if not paths:
        raise ValueError("--profile is required (tandem profile --out FILE writes one)")
    out: dict[int, Any] = {}
    for path in paths:
        prof = load_profile(path)
        if prof.tp_size in out:
            raise ValueError(
                f"--profile {path}: a second profile for tensor_parallel_size {prof.tp_size}"
            )
        out[prof.tp_size] = prof
    models = {p.meta.get("model") for p in out.values()} - {None}
    if len(models) > 1:
        raise ValueError(f"--profile: profiles of different models {sorted(models)}")
    return dict(sorted(out.items()))


def simulate_one(
    profile, workload, prefill: int, decode: int, args, decode_profile=None
) -> dict[str, Any]:
    from tandem.cluster.planner.metrics import summarize, ttft_parts
    from tandem.cluster.planner.simulator import Simulator

    dprof = decode_profile or profile
    sim = Simulator(profile, prefill, decode, decode_profile=decode_profile)
    records = sim.run(workload)
    s = summarize(records, args.ttft_slo_ms, args.itl_slo_ms)
    s["engine_cpu_s"] = sim.engine_cpu_s  # the engines' solo work (threads x steps)
    s["ttft_parts_ms"] = ttft_parts(records)  # medians of path, queue and step
    devices = prefill * profile.tp_size + decode * dprof.tp_size
    s.update(
        prefill=prefill,
        decode=decode,
        prefill_tp=profile.tp_size,
        decode_tp=dprof.tp_size,
        devices=devices,
        goodput_per_engine=s["goodput"] / (prefill + decode),
        goodput_per_device=s["goodput"] / devices,
    )
    return s


def cmd_simulate(args: argparse.Namespace) -> int:
    try:
        _check_slos(args, required=False)
        if args.prefill < 1:
            raise ValueError(f"--prefill must be >= 1, got {args.prefill}")
        if args.decode < 1:
            raise ValueError(f"--decode must be >= 1, got {args.decode}")
        profile = _profile(args)
        dprof = None
        if args.decode_profile:
            from tandem.cluster.planner.profile import load_profile

            try:
                dprof = load_profile(args.decode_profile)
            except ValueError as exc:
                raise ValueError(str(exc).replace("--profile", "--decode-profile", 1)) from None
        s = simulate_one(profile, load_workload(args), args.prefill, args.decode, args, dprof)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(s, indent=2) if args.json else format_summary(s))
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    try:
        _check_slos(args, required=True)
        if args.max_engines < 2:
            raise ValueError(
                f"--max-engines must be >= 2 (one prefill, one decode), got {args.max_engines}"
            )
        if args.max_devices is not None and args.max_devices < 2:
            raise ValueError(f"--max-devices must be >= 2, got {args.max_devices}")
        profiles = _profiles_by_tp(args.profile)
        workload = load_workload(args)
        rows = [
            simulate_one(profiles[tp], workload, p, d, args, profiles[tdp])
            for tp, p, tdp, d in plan_candidates(list(profiles), args.max_engines, args.max_devices)
        ]
        if not rows:
            raise ValueError(
                f"--max-devices {args.max_devices}: no split fits (the smallest engines "
                f"take {2 * min(profiles)} devices)"
            )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    rows.sort(
        key=lambda r: (
            -r["goodput_per_device"],
            r["devices"],
            r["prefill"] + r["decode"],
            r["prefill_tp"],
            r["decode_tp"],
            r["prefill"],
        )
    )
    profile = profiles[min(profiles)]  # the SLA arithmetic: the smallest engine shape
    model = sla_estimate(workload, profile, args)
    if args.json:
        print(json.dumps({"best": rows[0], "splits": rows, "sla_model": model}, indent=2))
    else:
        print(format_plan(rows))
        print(
            f"SLA model (mean rate {model['rate']:.3f} req/s, prompt {model['prompt_tokens']:.0f}, "
            f"output {model['output_tokens']:.0f} tokens): {model['prefill']}P{model['decode']}D "
            f"(TTFT p90 {model['ttft_p90_ms']:.1f} ms, ITL p90 {model['itl_p90_ms']:.2f} ms"
            + ("" if model["feasible"] else ", over an SLO at --max-engines")
            + ")"
        )
    return 0


def plan_candidates(
    tp_sizes: list[int], max_engines: int, max_devices: int | None
) -> list[tuple[int, int, int, int]]:
    """Every ``(prefill_tp, prefill engines, decode_tp, decode engines)`` with
    P + D <= ``max_engines`` and, when given, P x prefill_tp + D x decode_tp
    <= ``max_devices``."""
    out = []
    for tp in tp_sizes:
        for dtp in tp_sizes:
            for p in range(1, max_engines):
                for d in range(1, max_engines - p + 1):
                    if max_devices is None or p * tp + d * dtp <= max_devices:
                        out.append((tp, p, dtp, d))
    return out


def sla_estimate(workload: list[Any], profile: Any, args: argparse.Namespace) -> dict[str, Any]:
    """What cluster/planner/sla.py's arithmetic asks for at the workload's
    mean rate and lengths (each pool capped so that P + D <= --max-engines)."""
    from tandem.cluster.planner.sla import Load, required

    n = len(workload)
    span = max(r.arrival_s for r in workload) - min(r.arrival_s for r in workload)
    load = Load(
        rate=(n - 1) / span if n > 1 and span > 0 else 0.0,
        prompt_tokens=sum(len(r.prompt) for r in workload) / n,
        output_tokens=sum(r.output_len for r in workload) / n,
    )
    k = args.max_engines - 1
    pre, dec = required(load, profile, args.ttft_slo_ms, args.itl_slo_ms, max_engines=(k, k))
    return {
        "rate": load.rate,
        "prompt_tokens": load.prompt_tokens,
        "output_tokens": load.output_tokens,
        "prefill": pre.engines,
        "decode": dec.engines,
        "ttft_p90_ms": pre.p90_ms,
        "itl_p90_ms": dec.p90_ms,
        "feasible": pre.feasible and dec.feasible and pre.engines + dec.engines <= args.max_engines,
    }


def cmd_profile(args: argparse.Namespace) -> int:
    from tandem.cluster.planner.measure import measure
    from tandem.cluster.planner.profile import save_profile

    try:
        if args.transfer_bytes_per_s <= 0:
            raise ValueError("--transfer-bytes-per-s must be > 0")
        if args.transfer_latency_ms < 0:
            raise ValueError("--transfer-latency-ms must be >= 0")
        overrides = {}
        for name in ENGINE_LIMITS:
            v = getattr(args, name)
            if v is not None:
                if v < 1:
                    raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {v}")
                overrides[name] = v
        if args.shared_cores is not None and not args.shared_cores > 0:
            raise ValueError(f"--shared-cores must be > 0, got {args.shared_cores}")
        for name in ("device", "dtype"):
            if getattr(args, name) is not None:
                overrides[name] = getattr(args, name)
        profile = measure(
            model=args.model,
            prefill_tokens=_grid(args.prefill_tokens, "--prefill-tokens"),
            batch_sizes=_grid(args.decode_batch_sizes, "--decode-batch-sizes"),
            context_tokens=_grid(args.decode_context_tokens, "--decode-context-tokens"),
            shared_cores=args.shared_cores,
            repeats=args.repeats,
            transfer_bytes_per_s=args.transfer_bytes_per_s,
            transfer_latency_s=args.transfer_latency_ms / 1000.0,
            engine_overrides=overrides,
        )
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    save_profile(profile, args.out)
    print(f"wrote {args.out}")
    return 0


def _grid(text: str | None, flag: str) -> list[int] | None:
    """A comma-separated grid of positive integers, ascending; None: measure's default."""
    if not text:
        return None
    try:
        points = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{flag} takes comma-separated integers, got {text!r}") from None
    if not points or min(points) < 1 or points != sorted(set(points)):
        raise ValueError(f"{flag} takes distinct ascending integers >= 1, got {text!r}")
    return points


def format_summary(s: dict[str, Any]) -> str:
    lines = [
        f"{s['prefill']}P{s['decode']}D: {s['num_completed']}/{s['num_requests']} requests "
        f"in {s['duration_s']:.2f} s (simulated)",
        f"  request throughput  {s['request_throughput']:.3f} req/s",
        f"  output throughput   {s['output_token_throughput']:.1f} tok/s",
        f"  goodput             {s['goodput']:.3f} req/s ({s['num_good']} good; "
        f"TTFT SLO {s['ttft_slo_ms']} ms, ITL SLO {s['itl_slo_ms']} ms)",
        f"  {'':6} {'mean':>10} {'p50':>10} {'p90':>10} {'p99':>10}",
    ]
    for key, name in (("ttft_ms", "TTFT"), ("itl_ms", "ITL")):
        v = s[key]
        lines.append(
            f"  {name:6} " + " ".join(f"{v[k]:10.2f}" for k in ("mean", "p50", "p90", "p99"))
        )
    return "\n".join(lines)


def split_name(r: dict[str, Any]) -> str:
    """``2P1D``, or ``2P(tp2)1D(tp1)`` when a pool's engines have several devices."""
    if r.get("prefill_tp", 1) == 1 and r.get("decode_tp", 1) == 1:
        return f"{r['prefill']}P{r['decode']}D"
    return f"{r['prefill']}P(tp{r['prefill_tp']}){r['decode']}D(tp{r['decode_tp']})"


def format_plan(rows: list[dict[str, Any]]) -> str:
    width = max(6, *(len(split_name(r)) for r in rows))
    head = (
        f"{'split':>{width}} {'devices':>7} {'goodput/dev':>12} {'goodput':>9} "
        f"{'TTFT p90':>10} {'ITL p90':>9}"
    )
    lines = [head]
    for r in rows:
        lines.append(
            split_name(r).rjust(width)
            + f" {r['devices']:7d} {r['goodput_per_device']:12.3f} {r['goodput']:9.3f}"
            f" {r['ttft_ms']['p90']:10.1f} {r['itl_ms']['p90']:9.2f}"
        )
    b = rows[0]
    lines.append(
        f"best: {split_name(b)} ({b['goodput_per_device']:.3f} req/s per device, "
        f"{b['devices']} devices)"
    )
    return "\n".join(lines)


def add_parsers(sub: Any) -> None:
    p = sub.add_parser("profile", help="measure an engine's performance profile (JSON)")
    p.add_argument("--model", default="tiny")
    p.add_argument("--out", required=True, help="profile JSON to write")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per point (fastest kept)")
    p.add_argument(
        "--transfer-bytes-per-s",
        type=float,
        default=1.0e9,
        help="P->D KV handoff bandwidth (not measured here)",
    )
    p.add_argument(
        "--transfer-latency-ms",
        type=float,
        default=2.0,
        help="P->D KV handoff fixed latency (not measured here)",
    )
    p.add_argument(
        "--shared-cores",
        type=float,
        default=None,
        help="the engines of the deployment share this many CPU cores (a CPU box: nproc): "
        "the simulator stretches steps that overlap beyond them. Leave it out when each "
        "engine has a device of its own (GPU)",
    )
    for name, text in ENGINE_LIMITS.items():
        p.add_argument(
            "--" + name.replace("_", "-"),
            type=int,
            default=None,
            help=f"{text} (as tandem serve's flag; give the served engine's value)",
        )
    p.add_argument("--device", default=None, help="cpu or cuda (as tandem serve's flag)")
    p.add_argument("--dtype", default=None, help="the engine's dtype (as tandem serve's flag)")
    p.add_argument(
        "--prefill-tokens",
        default=None,
        help="prefill grid: prompt tokens per point, comma-separated (default 16,64,128,256,512; "
        "a GPU profile wants larger steps, e.g. 128,512,2048,8192)",
    )
    p.add_argument(
        "--decode-batch-sizes",
        default=None,
        help="decode grid: requests per step (default 1,4,16; on a GPU e.g. 1,16,64,256)",
    )
    p.add_argument(
        "--decode-context-tokens",
        default=None,
        help="decode grid: KV tokens the whole batch attends to (default 64,512,2048)",
    )
    p.set_defaults(func=cmd_profile)

    s = sub.add_parser("simulate", help="replay a workload through simulated xPyD engines")
    s.add_argument("--prefill", type=int, default=1, help="prefill engines")
    s.add_argument("--decode", type=int, default=1, help="decode engines")
    s.add_argument("--profile", help="performance profile JSON (tandem profile writes one)")
    s.add_argument(
        "--decode-profile",
        help="the decode pool's profile when its engines differ (e.g. another TP size; "
        "default: --profile)",
    )
    _add_workload(s)
    s.set_defaults(func=cmd_simulate)

    q = sub.add_parser("plan", help="simulate every xPyD split up to --max-engines")
    q.add_argument(
        "--profile",
        action="append",
        help="performance profile JSON; repeat it with one profile per tensor-parallel size "
        "to search each pool's TP size too",
    )
    q.add_argument("--max-engines", type=int, default=4, help="P + D at most")
    q.add_argument(
        "--max-devices",
        type=int,
        default=None,
        help="P x prefill TP + D x decode TP at most (default: no bound beyond --max-engines)",
    )
    _add_workload(q)
    q.set_defaults(func=cmd_plan)
