"""What ``tandem serve`` starts, from its resolved configuration
(``cluster/cli/config/``: defaults < YAML < command line): the pools' specs,
the cluster secret, the gateway's API config.

``serve.py`` (the command) and ``check_config.py`` (``--check-config``) both
read the configuration through here; this module starts nothing and imports neither.
"""

from __future__ import annotations

import dataclasses
import logging

from tandem.cluster.cli.config.load import resolve_config, serve_config
from tandem.cluster.cli.config.tree import ServeConfig
from tandem.cluster.engines.placement import ROLES

__all__ = [
    "ServeConfig",
    "api_config",
    "cluster_secret",
    "pool_specs",
    "resolve_config",
    "serve_config",
    "with_pool_counts",
]

logger = logging.getLogger("tandem.serve")


def cluster_secret(config: ServeConfig) -> bytes | None:
    """The internal planes' secret: read from ``cluster_secret_file``, else
    generated for this run; None only with ``internal_auth`` off."""
    from tandem.wire.auth import generate_secret, read_secret_file

    security = config.security
    if not security.internal_auth:
        logger.warning("internal auth is off: engine and KV sockets accept any peer")
        return None
    if security.cluster_secret_file:
        return read_secret_file(security.cluster_secret_file)
    return generate_secret()


def pool_specs(config: ServeConfig, secret: bytes | None = None):
    """One ``PoolSpec`` per pool that runs (ValueError naming the field)."""
    from tandem.cluster.engines.pools import PoolSpec

    specs = []
    for role in config.roles():
        num_gpus, resources = config.pools.placement(role)
        specs.append(
            PoolSpec(
                role,
                config.pools.pool(role).num_engines,
                config.pool_engine(role, secret),
                num_gpus,
                config.ray.max_restarts,
                resources=resources,
            )
        )
    return specs


def with_pool_counts(config: ServeConfig, counts: dict[str, int]) -> ServeConfig:
    """``config`` with the pool sizes of engines found running (``--attach``)."""
    pools = config.pools
    sized = {r: dataclasses.replace(pools.pool(r), num_engines=counts.get(r, 0)) for r in ROLES}
    return config.replace(pools=dataclasses.replace(pools, **sized))


def api_config(config: ServeConfig, model_path: str | None):
    """The gateway's ``ApiConfig`` (ValueError names the flag)."""
    from tandem.cluster.gateway.api.config import ApiConfig

    return ApiConfig.from_settings(config.api, model_path)
