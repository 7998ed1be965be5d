"""``tandem serve`` flags of the router, and its ``RoutingConfig`` from the
resolved serve settings (keys ``router``, ``router_*_weight``,
``router_busy_threshold``)."""

from __future__ import annotations

import argparse
from typing import Any

from cluster.routing.policy import ROUTER_POLICIES, RoutingConfig


def add_routing_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--router",
        choices=ROUTER_POLICIES,
        help="engine choice in each pool (default: kv-aware when a pool has more "
        "than one engine, else least-load)",
    )
    p.add_argument(
        "--router-hit-weight",
        type=float,
        help="kv-aware decode/colocated cost: weight of the uncached prompt share (default 1)",
    )
    p.add_argument(
        "--router-load-weight",
        type=float,
        help="kv-aware decode/colocated cost: weight of KV usage + running share (default 1)",
    )
    p.add_argument(
        "--router-prefill-queue-weight",
        type=float,
        help="kv-aware cost: weight of an engine's queued prefill tokens vs the "
        "prompt's uncached ones (default 1)",
    )
    p.add_argument(
        "--router-busy-threshold",
        type=float,
        help="kv-aware: a decode/colocated engine whose load (KV usage + running "
        "share) is above this is passed over while another is not, prefix "
        "or not (default 0.5; 100 = never)",
    )


def routing_config(settings: dict[str, Any]) -> RoutingConfig:
    """``ValueError`` naming the field for a bad policy or weight."""
    return RoutingConfig(
        router=settings.get("router"),
        hit_weight=float(settings.get("router_hit_weight", 1.0)),
        load_weight=float(settings.get("router_load_weight", 1.0)),
        prefill_queue_weight=float(settings.get("router_prefill_queue_weight", 1.0)),
        busy_threshold=float(settings.get("router_busy_threshold", 0.5)),
    )
