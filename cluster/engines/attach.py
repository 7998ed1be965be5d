"""Engines that outlive their gateway: adopt them, stop them.

A gateway crash must not take the engines down. ``tandem serve
--detach-engines`` starts the engine actors with Ray's detached lifetime on
a Ray cluster the gateway only joins (``--address``), so they survive the
gateway process. ``tandem serve --attach`` is the next gateway: it finds the
named actors of ``--ray-namespace`` instead of starting new ones and adopts
them. ``tandem stop-engines`` stops them for good.

    gateway A (session a)          engines (detached actors)        gateway B (session b > a)
    start_pools(detached) -------> prefill-0, decode-0 ...
    crashes; its streams die       still running A's requests
                                   <------------------------------ find_engines(namespace)
                                                                   check: model, secret
                                   attach(B's output socket, b) <- first health probe
                                   A's requests aborted, outputs
                                   go to B from now on

Sessions: each gateway takes ``time_ns()`` at start; an engine serves the
newest session that attached it and refuses older ones, so a stale gateway
that is still alive sees the newer session in ``ready()`` and stops using
the engine (its streams end with an error) instead of fighting over it.

Ownership at a normal exit: a gateway stops the engines it started, unless
they were started to outlive it (``--detach-engines``) or it adopted them
(``--attach``); those keep running until ``tandem stop-engines``.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any

from tandem.cluster.engines.pools import DEFAULT_NAMESPACE, EngineHandle, stop_pools

logger = logging.getLogger("tandem.attach")

ROLES = ("prefill", "decode", "colocated")


class AttachError(ValueError):
    """The engines of the namespace cannot be adopted (the message names the
    flag to fix); ``tandem serve`` prints it and exits 2."""


def find_engines(namespace: str) -> list[EngineHandle]:
    """The named engine actors of ``namespace``: ``<role>-0``, ``<role>-1`` ...
    for each role, up to the first index with no actor. A name may belong
    to an actor that died for good (Ray keeps it registered)."""
    import ray

    handles = []
    for role in ROLES:
        i = 0
        while True:
            name = f"{role}-{i}"
            try:
                actor = ray.get_actor(name, namespace=namespace)
            except ValueError:
                break
            handles.append(EngineHandle(name, role, actor, None, namespace))
            i += 1
    return handles


def adopt_engines(
    namespace: str, model: str, fingerprint: str | None, timeout_s: float = 120.0
) -> list[EngineHandle]:
    """The engines of ``namespace`` a gateway for ``model`` holding the
    secret with ``fingerprint`` may adopt: those answering ``ready()``
    (restarting ones are waited for up to ``timeout_s``); actors dead for
    good are left out. Each one's pool is the role it reports (a moved engine
    keeps its name). ``AttachError`` naming the flag when none is found,
    one does not answer, serves another model or holds another secret."""
    import ray

    found = find_engines(namespace)
    if not found:
        raise AttachError(
            f"--attach: no engine actors in Ray namespace {namespace!r} "
            "(start them with --detach-engines, or pass --ray-namespace)"
        )
    refs = {h.engine_id: h.actor.ready.remote() for h in found}
    adopted = []
    for h in found:
        try:
            info: dict[str, Any] = ray.get(refs[h.engine_id], timeout=timeout_s)
        except ray.exceptions.ActorDiedError:
            logger.warning(
                "%s in namespace %s is dead for good: not adopted", h.engine_id, namespace
            )
            continue
        if info["model"] != model:
            raise AttachError(
                f"--attach: {h.engine_id} in namespace {namespace!r} serves model "
                f"{info['model']!r}; this gateway was given --model {model!r}"
            )
        if info["secret_fingerprint"] != fingerprint:
            raise AttachError(
                f"--attach: {h.engine_id} in namespace {namespace!r} holds another cluster "
                "secret; pass the --cluster-secret-file its gateway was started with"
            )
        # an engine that moved pools (cluster/disagg/pool_move.py) keeps its name: its pool
        # is the role it reports
        h.role = info.get("role", h.role)
        adopted.append(h)
    if not adopted:
        raise AttachError(f"--attach: every engine actor in namespace {namespace!r} is dead")
    return adopted


def pool_counts(handles: list[EngineHandle]) -> dict[str, int]:
    return {role: sum(h.role == role for h in handles) for role in ROLES}


def stop_engines(namespace: str, timeout_s: float = 30.0) -> list[str]:
    """Stop every engine actor of ``namespace`` (detached ones included) and
    wait until their names are free; returns the engine ids stopped."""
    handles = find_engines(namespace)
    stop_pools(handles, timeout_s=timeout_s)
    return [h.engine_id for h in handles]


def add_stop_engines_parser(sub: Any) -> None:
    p = sub.add_parser(
        "stop-engines",
        help="stop the engine actors a gateway left running (--detach-engines)",
    )
    p.add_argument("--address", help="Ray address to join (default: $RAY_ADDRESS)")
    p.add_argument(
        "--ray-namespace",
        default=DEFAULT_NAMESPACE,
        help=f"the engines' Ray namespace (default {DEFAULT_NAMESPACE})",
    )
    p.set_defaults(func=cmd_stop_engines)


def cmd_stop_engines(args: argparse.Namespace) -> int:
    import ray

    ray.init(address=args.address or "auto", log_to_driver=False)
    try:
        stopped = stop_engines(args.ray_namespace)
    finally:
        ray.shutdown()
    if not stopped:
        print(f"no engine actors in namespace {args.ray_namespace!r}", file=sys.stderr)
        return 1
    print(f"stopped {', '.join(stopped)} in namespace {args.ray_namespace!r}", flush=True)
    return 0
