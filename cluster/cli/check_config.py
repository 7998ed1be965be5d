"""``tandem serve --check-config``: validate flags + YAML, print what would run.

Resolves the configuration exactly as ``tandem serve`` does (defaults < YAML
< command line, per-pool overrides, engine config validation), then prints it
as JSON and exits 0, or prints ``error: ...`` naming the field and exits 2:

    serve    every setting by its flat key (the keys a YAML file uses)
    config   the same settings as the typed tree, by section (also a valid --config)
    pools    each pool that would start, its size range and resolved engine config

Starts no Ray, loads no model and touches no file except ``--config``: a
model directory is checked where it is mounted, when the engines start.
API keys are printed as ``"<set>"``, never in clear.
"""

from __future__ import annotations

import json
import sys
from typing import Any, TextIO

from tandem.cluster.cli.config.keys import flatten, tree
from tandem.cluster.cli.settings import ServeConfig, pool_specs, resolve_config


def resolved_config(config: ServeConfig) -> dict:
    """The settings by key, by section, and one entry per pool that would start."""
    pools = []
    for spec in pool_specs(config):
        engine = spec.config.flat()  # by flat key, as the YAML names them
        for key in ("engine_id", "epoch", "extra", "cluster_secret"):  # secret: per run
            engine.pop(key, None)
        pools.append(
            {
                "role": spec.role,
                "num_engines": spec.num_engines,
                # the sizes a resize may reach (cluster/disagg/scaling.py)
                "min_engines": config.pools.pool(spec.role).min_engines,
                "max_engines": config.pools.pool(spec.role).max_engines,
                "num_gpus_per_engine": spec.num_gpus,
                "ray_resources": dict(spec.resources),
                "max_restarts": spec.max_restarts,
                "engine": engine,
            }
        )
    return {"serve": flatten(config), "config": tree(config), "pools": pools}


def check_config(args: Any, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int:
    try:
        config = resolved_config(resolve_config(args))
    except (ValueError, TypeError, OSError) as exc:
        print(f"error: {exc}", file=err)
        return 2
    print(json.dumps(config, indent=2, sort_keys=True), file=out)
    return 0
