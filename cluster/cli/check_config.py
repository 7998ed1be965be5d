"""``tandem serve --check-config``: validate flags + YAML, print what would run.

Resolves the configuration exactly as ``tandem serve`` does (defaults < YAML
< command line, per-pool overrides, engine config validation), then prints it
as JSON and exits 0, or prints ``error: ...`` naming the field and exits 2.
Starts no Ray, loads no model and touches no file except ``--config``: a
model directory is checked where it is mounted, when the engines start.
The API key is printed as ``"<set>"``, never in clear.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from typing import Any, TextIO

from cluster.cli.settings import gateway_limits, pool_specs, resolve_settings


def resolved_config(settings: dict[str, Any], per_role: dict[str, dict[str, Any]]) -> dict:
    """The serve settings and one entry per pool that would start."""
    serve = dict(settings)
    for key in ("api_key", "admin_api_key"):
        if serve.get(key):
            serve[key] = "<set>"
    pools = []
    for spec in pool_specs(settings, per_role):
        engine = dataclasses.asdict(spec.config)
        for key in ("engine_id", "epoch", "extra", "cluster_secret"):  # secret: per run
            engine.pop(key, None)
        pools.append(
            {
                "role": spec.role,
                "num_engines": spec.num_engines,
                "num_gpus_per_engine": spec.num_gpus,
                "ray_resources": dict(spec.resources),
                "max_restarts": spec.max_restarts,
                "engine": engine,
            }
        )
    return {"serve": serve, "pools": pools}


def check_config(args: Any, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int:
    try:
        settings, per_role = resolve_settings(args)
        gateway_limits(settings)
        config = resolved_config(settings, per_role)
    except (ValueError, TypeError, OSError) as exc:
        print(f"error: {exc}", file=err)
        return 2
    print(json.dumps(config, indent=2, sort_keys=True), file=out)
    return 0
