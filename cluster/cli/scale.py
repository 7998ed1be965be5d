"""``tandem scale``: the command-line client of ``POST /admin/pools/{pool}``.

    tandem scale --prefill 2 --decode 3 --url http://127.0.0.1:8000 --admin-api-key KEY
    tandem scale --colocated 4
    tandem scale --move decode:prefill                 # one engine changes pool
    tandem scale --move decode:prefill --engine-id decode-1

Each pool given is resized in turn (prefill, decode, colocated) while the
server keeps serving (cluster/disagg/scaling.py). The key comes from
``--admin-api-key`` or ``$TANDEM_ADMIN_API_KEY``. Prints each pool's JSON
answer, one line each; exits 0 when every pool reached its size, 1 when an
engine failed to start or to drain in time, 2 on a refused call (e.g. a size
outside the pool's --{pool}-min-engines / --{pool}-max-engines).

``--move SOURCE:DEST`` (repeatable, before any resize) moves one running engine
from pool SOURCE to pool DEST without a restart (``POST /admin/pools/move``,
cluster/disagg/pool_move.py): exit 1 when it could not move (it serves on in its
pool), 2 when refused (e.g. the pools' engines differ, or SOURCE's last engine).
"""

from __future__ import annotations

import argparse
import json
import sys

from tandem.cluster.cli.drain import admin_post

POOLS = ("prefill", "decode", "colocated")


def add_scale_parser(sub) -> None:
    p = sub.add_parser("scale", help="resize engine pools of a running server (admin API)")
    for pool in POOLS:
        p.add_argument(f"--{pool}", type=int, metavar="N", help=f"{pool} engines wanted")
    p.add_argument(
        "--move",
        action="append",
        default=[],
        metavar="SOURCE:DEST",
        help="move one engine from pool SOURCE to pool DEST (decode:prefill or prefill:decode)",
    )
    p.add_argument(
        "--engine-id", help="with one --move: the engine to move (default: the least loaded)"
    )
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the gateway's base URL")
    p.add_argument("--admin-api-key", help="default: $TANDEM_ADMIN_API_KEY")
    p.add_argument(
        "--timeout-s", type=float, default=900.0, help="HTTP timeout per pool (default 900)"
    )
    p.set_defaults(func=cmd_scale)


def cmd_scale(args: argparse.Namespace) -> int:
    wanted = [(pool, getattr(args, pool)) for pool in POOLS if getattr(args, pool) is not None]
    if not wanted and not args.move:
        print(
            "error: give at least one of --prefill, --decode, --colocated, --move", file=sys.stderr
        )
        return 2
    if args.engine_id and len(args.move) != 1:
        print("error: --engine-id goes with exactly one --move", file=sys.stderr)
        return 2
    rc = 0
    for move in args.move:
        source, _, dest = move.partition(":")
        if not source or not dest:
            print(f"error: --move {move!r}: SOURCE:DEST, e.g. decode:prefill", file=sys.stderr)
            return 2
        body = {"source_pool": source, "dest_pool": dest}
        if args.engine_id:
            body["engine_id"] = args.engine_id
        result = admin_post(args, "/admin/pools/move", body)
        if result is None or result[0] != 200:
            return 2
        print(json.dumps(result[1]), flush=True)
        if not result[1].get("moved"):
            rc = 1
    for pool, engines in wanted:
        result = admin_post(args, f"/admin/pools/{pool}", {"engines": engines})
        if result is None or result[0] != 200:
            return 2
        body = result[1]
        print(json.dumps(body), flush=True)
        if body.get("failed") or any(not s.get("idle") for s in body.get("stopped", ())):
            rc = 1
    return rc
