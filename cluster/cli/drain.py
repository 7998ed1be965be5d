"""``tandem drain ENGINE_ID``: the command-line client of ``POST /admin/drain``.

    tandem drain decode-0 --url http://127.0.0.1:8000 --admin-api-key KEY
    tandem drain decode-0 --undo            # take new work again

The key comes from ``--admin-api-key`` or ``$TANDEM_ADMIN_API_KEY``. Prints the
gateway's JSON answer; exits 0 when the engine is drained and idle (or
undrained), 1 when it did not go idle in time, 2 on a refused call.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def add_drain_parser(sub) -> None:
    p = sub.add_parser("drain", help="drain an engine of a running server (admin API)")
    p.add_argument("engine_id", help="e.g. decode-0")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the gateway's base URL")
    p.add_argument("--admin-api-key", help="default: $TANDEM_ADMIN_API_KEY")
    p.add_argument("--undo", action="store_true", help="undrain: let it take new work again")
    p.add_argument("--timeout-s", type=float, default=120.0, help="HTTP timeout (default 120)")
    p.set_defaults(func=cmd_drain)


def admin_post(args: argparse.Namespace, path: str, body: dict) -> tuple[int, dict] | None:
    """POST ``body`` to the gateway's admin ``path`` with the admin key
    (``--admin-api-key`` or ``$TANDEM_ADMIN_API_KEY``). Returns ``(status,
    JSON answer)``, or None after printing why the call was not made."""
    import httpx

    key = args.admin_api_key or os.environ.get("TANDEM_ADMIN_API_KEY")
    if not key:
        print("error: --admin-api-key (or $TANDEM_ADMIN_API_KEY) is required", file=sys.stderr)
        return None
    try:
        r = httpx.post(
            args.url.rstrip("/") + path,
            json=body,
            headers={"Authorization": f"Bearer {key}"},
            timeout=args.timeout_s,
        )
    except httpx.HTTPError as exc:
        print(f"error: {args.url}: {exc}", file=sys.stderr)
        return None
    try:
        answer = r.json()
    except ValueError:
        answer = {"error": {"message": r.text}}
    if r.status_code != 200:
        message = answer.get("error", {}).get("message", answer)
        print(f"error: {r.status_code}: {message}", file=sys.stderr)
    return r.status_code, answer


def cmd_drain(args: argparse.Namespace) -> int:
    path = "/admin/undrain" if args.undo else "/admin/drain"
    result = admin_post(args, path, {"engine_id": args.engine_id})
    if result is None or result[0] != 200:
        return 2
    body = result[1]
    print(json.dumps(body))
    return 0 if args.undo or body.get("idle") else 1
