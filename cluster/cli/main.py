"""The ``tandem`` command: ``generate`` (offline), ``serve``, ``drain``, ``scale``,
``stop-engines``, ``bench``, ``profile``, ``simulate``, ``plan``."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from tandem.cluster.cli.config.tree import ServeConfig
from tandem.workers.config import EngineConfig, add_engine_arguments, engine_overrides

# engine settings of the KV connector and KV events: tandem generate's one
# in-process engine has neither
SERVE_ONLY_ENGINE_FIELDS = (
    "kv_port",
    "kv_lease_s",
    "kv_load_timeout_s",
    "load_failure_policy",
    "kv_events_port",
    "kv_events_queue_batches",
)


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--prompt-token-ids must be comma-separated integers, got {text!r}"
        ) from None


def cmd_generate(args: argparse.Namespace) -> int:
    from tandem.wire.engine_protocol import SamplingParams
    from tandem.workers.engine.llm import LLM

    # say where a GGUF model's converted copy is (first start: how long it took)
    logging.basicConfig(format="%(message)s", stream=sys.stderr)
    logging.getLogger("tandem.workers.checkpoints").setLevel(logging.INFO)
    if not args.prompt and not args.prompt_token_ids:
        print("error: give at least one --prompt or --prompt-token-ids", file=sys.stderr)
        return 2
    try:
        sp = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed_per_request,
            ignore_eos=args.ignore_eos,
        )
        sp.validate()
        cfg = EngineConfig.from_flat(model=args.model, **engine_overrides(args))
        llm = LLM(cfg)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        results = llm.generate(args.prompt or [], sp, prompt_token_ids=args.prompt_token_ids or [])
    finally:
        llm.close()  # stops tensor-parallel workers
    for r in results:
        if args.json:
            d = {
                "prompt_token_ids": r.prompt_token_ids,
                "token_ids": r.token_ids,
                "text": r.text,
                "finish_reason": r.finish_reason,
            }
            if r.error:
                d["error"] = r.error
            print(json.dumps(d), flush=True)
        else:
            print(r.text if not r.error else f"error: {r.error}", flush=True)
    return 1 if any(r.error for r in results) else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description="Disaggregated LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="offline generation with one in-process engine")
    model = ServeConfig.__dataclass_fields__["model"]  # the same default as tandem serve
    g.add_argument("--model", default=model.default, help=model.metadata["option"].help)
    g.add_argument("--prompt", action="append", help="prompt text (repeatable)")
    g.add_argument(
        "--prompt-token-ids", action="append", type=_parse_ids, help="1,2,3 (repeatable)"
    )
    g.add_argument("--max-tokens", type=int, default=16)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument(
        "--seed",
        dest="seed_per_request",
        type=int,
        default=None,
        help="sampling seed of each request",
    )
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--json", action="store_true", help="one JSON object per prompt")
    add_engine_arguments(g, exclude=SERVE_ONLY_ENGINE_FIELDS)
    g.set_defaults(func=cmd_generate)

    try:
        from tandem.cluster.cli.serve import add_serve_parser

        add_serve_parser(sub)
    except ImportError:
        pass
    try:
        from tandem.cluster.cli.drain import add_drain_parser

        add_drain_parser(sub)
    except ImportError:
        pass
    try:
        from tandem.cluster.cli.scale import add_scale_parser

        add_scale_parser(sub)
    except ImportError:
        pass
    try:
        from tandem.cluster.engines.attach import add_stop_engines_parser

        add_stop_engines_parser(sub)
    except ImportError:
        pass
    try:
        from tandem.cluster.cli import bench

        b = sub.add_parser("bench", help="load generator against a running gateway")
        bench.add_arguments(b)
        b.set_defaults(func=lambda a: bench.run_from_args(a))
    except (ImportError, AttributeError):
        pass
    try:
        from tandem.cluster.cli.simulate import add_parsers

        add_parsers(sub)  # profile, simulate, plan
    except ImportError:
        pass
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
