"""The settings of ``tandem serve``: defaults < YAML < command line, and the
per-component configs built from them (pools, gateway limits, API config,
migration policy, the cluster secret).

``serve.py`` (the command) and ``check_config.py`` (``--check-config``) both
read settings through here; this module starts nothing and imports neither.
"""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any

from cluster.engines.placement import (
    check_pool_parallel,
    gpu_share,
    pool_placement,
    resolve_placement,
)
from cluster.routing.settings import routing_config
from workers.config import EngineConfig, engine_overrides

logger = logging.getLogger("tandem.serve")

SERVE_DEFAULTS: dict[str, Any] = {
    "model": "smollm2",
    "prefill": 1,
    "decode": 1,
    "colocated": 0,
    "host": "127.0.0.1",
    "port": 8000,
    "api_key": None,
    "address": None,
    "disagg_min_tokens": 0,
    "max_restarts": 3,
    "num_gpus_per_engine": 0,
    "kv_lease_s": 60.0,
    "load_failure_policy": "recompute",
    # gateway limits (cluster/gateway/edge/limits.py)
    "max_request_body_mb": 8.0,
    "max_num_requests": 0,
    "request_timeout_s": 600.0,
    "tokenizer_workers": 2,
    "max_logprobs": 20,
    # per pool (cluster.engines.placement): Ray custom resources and GPUs per engine
    "prefill_ray_resources": {},
    "decode_ray_resources": {},
    "colocated_ray_resources": {},
    "prefill_num_gpus_per_engine": None,
    "decode_num_gpus_per_engine": None,
    "colocated_num_gpus_per_engine": None,
    "cluster_secret_file": None,
    "internal_auth": True,
    # engine health (cluster/engines/health.py)
    "engine_dead_after_s": 30.0,
    "engine_call_timeout_s": 5.0,  # a slower Ray control call is no verdict
    "max_queued_outputs": 512,
    # API surface (cluster/gateway/api/config.py)
    "served_model_name": None,
    "chat_template": None,
    "generation_config": "auto",
    # router (cluster/routing/policy.py): None = kv-aware when a pool has > 1 engine
    "router": None,
    "router_hit_weight": 1.0,
    "router_load_weight": 1.0,
    "router_prefill_queue_weight": 1.0,
    "router_busy_threshold": 0.5,
    # operators (cluster/observability/logging_setup.py, cluster/observability/tracing/)
    "log_format": "text",
    "otlp_traces_endpoint": None,
    # fault tolerance (cluster/disagg/migration.py, cluster/gateway/api/admin.py, cluster/engines/pools.py)
    "ray_namespace": "tandem",
    "migration": True,
    "max_migrations": 3,
    "migration_handoff_min_tokens": 256,
    "migration_wait_s": 30.0,
    "admin_api_key": None,
    # engines that outlive the gateway (cluster/engines/attach.py)
    "detach_engines": False,
    "attach": False,
}


def resolve_settings(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """Merge defaults < YAML file < command line. Returns (serve settings,
    engine overrides per role)."""
    file_cfg: dict[str, Any] = {}
    if getattr(args, "config", None):
        import yaml

        with open(args.config) as f:
            file_cfg = yaml.safe_load(f) or {}
        if not isinstance(file_cfg, dict):
            raise ValueError(f"--config {args.config}: expected a mapping at the top level")
    settings = dict(SERVE_DEFAULTS)
    unknown = (
        set(file_cfg)
        - set(SERVE_DEFAULTS)
        - set(EngineConfig.__dataclass_fields__)
        - {
            "prefill_engine",
            "decode_engine",
            "colocated_engine",
        }
    )
    if unknown:
        raise ValueError(f"--config: unknown keys {sorted(unknown)}")
    if "cluster_secret" in file_cfg:
        raise ValueError("--config: cluster_secret cannot be inline; use cluster_secret_file")
    for k in SERVE_DEFAULTS:
        if k in file_cfg:
            settings[k] = file_cfg[k]
        v = getattr(args, k, None)
        if v is not None:
            settings[k] = v
    common = {
        k: v
        for k, v in file_cfg.items()
        if k in EngineConfig.__dataclass_fields__ and k not in SERVE_DEFAULTS
    }
    common.update(engine_overrides(args))
    per_role = {}
    for role in ("prefill", "decode", "colocated"):
        o = dict(common)
        role_cfg = file_cfg.get(f"{role}_engine", {}) or {}
        if not isinstance(role_cfg, dict):
            raise ValueError(f"--config: {role}_engine must be a mapping")
        bad = set(role_cfg) - set(EngineConfig.__dataclass_fields__)
        if bad:
            raise ValueError(f"--config: unknown keys in {role}_engine: {sorted(bad)}")
        o.update(role_cfg)
        o.update(engine_overrides(args, prefix=f"{role}-"))
        per_role[role] = o
    if settings["colocated"]:
        settings["prefill"] = settings["decode"] = 0
    elif settings["prefill"] < 0 or settings["decode"] < 1:
        raise ValueError("--decode must be >= 1 and --prefill >= 0 (or use --colocated K)")
    resolve_placement(settings)
    routing_config(settings)  # ValueError naming a bad router setting
    from cluster.observability.tracing.settings import check_settings

    check_settings(settings)
    migration_policy(settings)  # ValueError naming the field
    check_engine_lifetime(settings)
    return settings, per_role


def check_engine_lifetime(settings: dict[str, Any]) -> None:
    """ValueError naming the flag when engines meant to outlive the gateway
    (``--detach-engines``, ``--attach``) could not: they need a Ray cluster the
    gateway only joins (a local Ray started by the gateway dies with it) and
    a cluster secret the next gateway can hold too."""
    flags = [
        f
        for f, k in (("--detach-engines", "detach_engines"), ("--attach", "attach"))
        if settings.get(k)
    ]
    if not flags:
        return
    if len(flags) == 2:
        raise ValueError(
            "--attach adopts running engines, --detach-engines starts new ones: pass one"
        )
    if not (settings["address"] or os.environ.get("RAY_ADDRESS")):
        raise ValueError(
            f"{flags[0]}: engines outlive the gateway only on a Ray cluster it joins "
            "(ray start --head, then pass --address)"
        )
    if settings["internal_auth"] and not settings["cluster_secret_file"]:
        raise ValueError(
            f"{flags[0]}: pass --cluster-secret-file (the next gateway must hold the "
            "engines' secret)"
        )


def migration_policy(settings: dict[str, Any]):
    """The backend's ``MigrationPolicy`` from serve settings."""
    from cluster.disagg.migration import MigrationPolicy

    s = {k: settings.get(k, SERVE_DEFAULTS[k]) for k in SERVE_DEFAULTS}
    return MigrationPolicy(
        enabled=bool(s["migration"]),
        max_migrations=s["max_migrations"],
        handoff_min_tokens=s["migration_handoff_min_tokens"],
        wait_for_engine_s=s["migration_wait_s"],
    )


def cluster_secret(settings: dict[str, Any]) -> bytes | None:
    """The internal planes' secret: read from ``cluster_secret_file``, else
    generated for this run; None only with ``internal_auth`` off."""
    from wire.auth import generate_secret, read_secret_file

    if not settings["internal_auth"]:
        logger.warning("internal auth is off: engine and KV sockets accept any peer")
        return None
    if settings["cluster_secret_file"]:
        return read_secret_file(settings["cluster_secret_file"])
    return generate_secret()


def pool_specs(
    settings: dict[str, Any], per_role: dict[str, dict[str, Any]], secret: bytes | None = None
):
    from cluster.engines.pools import PoolSpec

    # Callers that build settings themselves (ServiceThread, tests) skip
    # resolve_settings: per-pool placement defaults are filled here too.
    resolve_placement(settings)
    kv_events = (
        routing_config(settings).resolve(
            {r: settings[r] for r in ("prefill", "decode", "colocated")}
        )
        == "kv-aware"
    )
    specs = []
    for role in ("prefill", "decode", "colocated"):
        n = settings[role]
        if not n:
            continue
        num_gpus, resources = pool_placement(settings, role)
        cfg = EngineConfig(
            model=settings["model"],
            role=role,
            kv_connector=None if role == "colocated" else "nixl",
            kv_lease_s=settings["kv_lease_s"],
            load_failure_policy=settings["load_failure_policy"],
            kv_host="auto" if settings["address"] else "127.0.0.1",
            cluster_secret=secret,
            log_format=settings.get("log_format", "text"),
            **{"kv_events": kv_events, **gpu_share(num_gpus, per_role[role], role)},
        )
        check_pool_parallel(role, cfg, num_gpus)
        specs.append(
            PoolSpec(role, n, cfg, num_gpus, settings["max_restarts"], resources=resources)
        )
    return specs


def api_config(settings: dict[str, Any], model_path: str | None):
    """The gateway's ``ApiConfig`` (ValueError names the flag)."""
    from cluster.gateway.api.config import ApiConfig

    return ApiConfig.from_settings(settings, model_path)


def gateway_limits(settings: dict[str, Any]):
    """The gateway's ``GatewayLimits`` from serve settings (ValueError names the field)."""
    from cluster.gateway.edge.limits import GatewayLimits

    names = (
        "max_request_body_mb",
        "max_num_requests",
        "request_timeout_s",
        "tokenizer_workers",
        "max_logprobs",
    )
    return GatewayLimits(**{k: settings.get(k, SERVE_DEFAULTS[k]) for k in names})
