"""``ServeConfig``: every setting of ``tandem serve`` in one typed tree.

    ServeConfig
      model          str                      --model
      server         ServerConfig             --host, --port                  (here)
      pools          PoolsConfig              --prefill/--decode/--colocated,
                       prefill|decode|colocated: PoolConfig    GPUs, resources,
                       (num_engines, num_gpus_per_engine,      per-pool engine
                        ray_resources, engine overrides)       settings
                                                               (cluster/engines/placement.py)
      engine         EngineConfig             every pool's engine (workers/config/):
                       model, cache, offload, scheduler, parallel, graphs,
                       kv_transfer, output, runtime: one section each
      limits         GatewayLimits            (cluster/gateway/edge/limits.py)
      routing        RoutingConfig            (cluster/routing/policy.py)
      migration      MigrationPolicy          (cluster/disagg/migration.py)
      health         HealthConfig             (cluster/engines/health.py)
      ray            RayConfig                Ray, engine lifetime (cluster/engines/pools.py)
      security       SecurityConfig           (here)
      observability  ObservabilityConfig      (cluster/observability/tracing/settings.py)
      api            ApiSettings              (cluster/gateway/api/config.py)

Each leaf field carries its default, help and flag (``wire/config_fields.py``):
the command line (``args.py``), the YAML keys (``keys.py``, ``load.py``) and the
reference page (``reference.py``) are generated from it. Construction
validates (ValueError naming the field), the pools' engines included.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

from tandem.cluster.disagg.migration import MigrationPolicy
from tandem.cluster.engines.health import HealthConfig
from tandem.cluster.engines.placement import ROLES, PoolsConfig, check_pool_parallel, gpu_share
from tandem.cluster.engines.pool_moves import MOVE_ROLES, moves_blocker
from tandem.cluster.engines.pools import RayConfig
from tandem.cluster.gateway.api.config import ApiSettings
from tandem.cluster.gateway.edge.limits import GatewayLimits
from tandem.cluster.observability.tracing.settings import ObservabilityConfig
from tandem.cluster.planner.config import PlannerConfig
from tandem.cluster.routing.policy import RoutingConfig
from tandem.wire.config_fields import OptionMeta, describe, option
from tandem.workers.config import EngineConfig, engine_leaf


@dataclass(frozen=True)
class ServerConfig:
    """Where the gateway listens."""

    host: str = option("127.0.0.1", help="gateway host")
    port: int = option(8000, help="gateway port")
    api_server_count: int = option(
        1,
        help="gateway processes on --port (SO_REUSEPORT) over the same engines; above 1 "
        "this process starts the engines and the gateways and restarts a gateway that dies",
    )

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if self.api_server_count < 1:
            raise ValueError(f"api_server_count must be >= 1, got {self.api_server_count}")


@dataclass(frozen=True)
class SecurityConfig:
    """Who may call the gateway, and the internal planes' secret (wire/auth.py)."""

    api_key: str | None = option(
        None, repr=False, secret=True, help="require 'Authorization: Bearer KEY' on /v1/*"
    )
    admin_api_key: str | None = option(
        None,
        repr=False,
        secret=True,
        default_text="none (the admin routes answer 403)",
        help="opens the admin routes (POST /admin/drain, /admin/undrain, /admin/pools/POOL, "
        "...) with 'Authorization: Bearer KEY'",
    )
    cluster_secret_file: str | None = option(
        None,
        default_text="a fresh random secret per tandem serve",
        help="file holding the secret of the internal planes (>= 16 bytes)",
    )
    internal_auth: bool = option(
        True,
        help="CURVE on the engine sockets and the KV side channel; --no-internal-auth is "
        "for development only: anyone who can reach them is trusted",
    )


# MigrationPolicy's module belongs to another change in flight (cluster/disagg/);
# its fields are described from here until their docs can move into it.
describe(
    MigrationPolicy,
    enabled=OptionMeta(
        key="migration",
        help="a stream whose decode engine dies moves to another one (--no-migration: "
        "it ends with an error)",
    ),
    max_migrations=OptionMeta(help="migrations per request"),
    handoff_min_tokens=OptionMeta(
        key="migration_handoff_min_tokens",
        help="migrated contexts lacking this many tokens on the new engine get KV from a "
        "prefill engine; fewer are recomputed on decode",
    ),
    wait_for_engine_s=OptionMeta(
        key="migration_wait_s", help="how long a migrating stream waits for a ready engine"
    ),
)


# attribute -> the section's title (--help groups, the reference page)
SECTION_TITLES = {
    "model": "Model",
    "server": "Gateway server",
    "pools": "Pools and placement",
    "engine": "Engine",  # its fields go by their own sections (workers.config.ENGINE_SECTIONS)
    "limits": "Gateway limits",
    "routing": "Routing",
    "migration": "Decode migration",
    "health": "Engine health",
    "ray": "Ray and engine lifetime",
    "security": "Security",
    "observability": "Logging and tracing",
    "api": "API surface",
    "planning": "Planner (elastic pools)",
}


@dataclass(frozen=True)
class ServeConfig:
    """The whole of ``tandem serve``'s configuration (module doc)."""

    model: str = option(
        "smollm2", help="'smollm2', 'tiny', a .gguf file, a local directory or a hub id"
    )
    server: ServerConfig = option(default_factory=ServerConfig, help=SECTION_TITLES["server"])
    pools: PoolsConfig = option(default_factory=PoolsConfig, help=SECTION_TITLES["pools"])
    engine: EngineConfig = option(default_factory=EngineConfig, help="every pool's engine")
    limits: GatewayLimits = option(default_factory=GatewayLimits, help=SECTION_TITLES["limits"])
    routing: RoutingConfig = option(default_factory=RoutingConfig, help="routing")
    migration: MigrationPolicy = option(default_factory=MigrationPolicy, help="migration")
    health: HealthConfig = option(default_factory=HealthConfig, help="engine health")
    ray: RayConfig = option(default_factory=RayConfig, help=SECTION_TITLES["ray"])
    security: SecurityConfig = option(default_factory=SecurityConfig, help="security")
    observability: ObservabilityConfig = option(
        default_factory=ObservabilityConfig, help="logs and traces"
    )
    api: ApiSettings = option(default_factory=ApiSettings, help=SECTION_TITLES["api"])
    planning: PlannerConfig = option(default_factory=PlannerConfig, help=SECTION_TITLES["planning"])

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("model may not be empty")
        self._check_engine_lifetime()
        self._check_planner()
        for role in self.roles():
            self.pool_engine(role)  # ValueError naming the field, before anything starts

    def roles(self) -> list[str]:
        """The pools that run, in start order."""
        return [r for r in ROLES if self.pools.pool(r).num_engines]

    def pool_engine(self, role: str, cluster_secret: bytes | None = None) -> EngineConfig:
        """The engine config of one pool: the engine section, the pool's own
        settings over it, and what ``tandem serve`` sets (role, connector,
        KV events for kv-aware routing, log format, the secret, and
        ``kv_pool_moves`` where engines may move between the pools)."""
        config = self._pool_engine(role, cluster_secret)
        if role in MOVE_ROLES and self.pool_moves_off() is None:
            config = config.replace(kv_pool_moves=True)
        return config

    def pool_moves_off(self) -> str | None:
        """Why an engine may not move between the prefill and decode pools
        (None: it may; cluster/engines/pool_moves.py)."""
        if self.ray.attach:
            return (
                "this gateway adopted its engines (--attach): the one that started them moves them"
            )
        return moves_blocker(self.pools, self._pool_engine, self.pools.pool_moves)

    def _pool_engine(self, role: str, cluster_secret: bytes | None = None) -> EngineConfig:
        num_gpus, _ = self.pools.placement(role)
        overrides = dict(self.pools.pool(role).engine)
        util = self.engine.cache.gpu_memory_utilization
        if util != engine_leaf("gpu_memory_utilization").default:  # given for every pool
            overrides.setdefault("gpu_memory_utilization", util)
        kv_events = self.routing.resolve(self.pools.reach()) == "kv-aware"
        config = self.engine.replace(
            model=self.model,
            role=role,
            kv_connector=self._kv_connector(role, overrides),
            kv_host="auto" if self.ray.address else "127.0.0.1",
            cluster_secret=cluster_secret,
            log_format=self.observability.log_format,
            kv_events=kv_events,
            kv_borrows_tiers=role == "prefill" and self._lenders_keep_tiers(),
            **gpu_share(num_gpus, overrides, role),
        )
        check_pool_parallel(role, config, num_gpus)
        return config

    def _kv_connector(self, role: str, overrides: dict[str, Any]) -> str | None:
        """Prefill and decode engines exchange KV over NIXL. A colocated pool gets the
        connector too when its engines keep a host KV tier and there is more than one
        of them, so they lend tier prefixes to each other (kvtransfer/tiers/export.py);
        not under tensor parallelism, where each rank keeps its own tiers (no lending)."""
        if role != "colocated":
            return "nixl"
        tiers = overrides.get("kv_offloading_size", self.engine.offload.kv_offloading_size)
        tp = overrides.get("tensor_parallel_size", self.engine.parallel.tensor_parallel_size)
        lends = bool(tiers) and self.pools.pool(role).num_engines > 1 and tp == 1
        return "nixl" if lends else None

    def _lenders_keep_tiers(self) -> bool:
        """Does a prefill or decode pool keep a host KV tier? Then a prefill engine
        may be lent a prefix before it prefills, so it reads as well as serves
        (``kv_role`` "both"; cluster/disagg/tier_lending.py)."""
        reach = self.pools.reach()  # a pool the planner may grow counts
        return any(
            self.pools.pool(r).engine.get(
                "kv_offloading_size", self.engine.offload.kv_offloading_size
            )
            for r in ("prefill", "decode")
            if reach.get(r)
        )

    def replace(self, **changes: Any) -> ServeConfig:
        return dataclasses.replace(self, **changes)

    def _check_planner(self) -> None:
        """A running planner needs each pool's maximum, and ``sla`` a P/D split
        (ValueError naming the field)."""
        mode = self.planning.planner
        if mode == "off":
            return
        for role in self.roles():
            if self.pools.pool(role).max_engines is None:
                raise ValueError(
                    f"{role}_max_engines (--{role}-max-engines): --planner {mode} needs "
                    "the most engines it may start"
                )
        if mode == "sla" and "colocated" in self.roles():
            raise ValueError(
                "planner: --planner sla plans prefill and decode pools; use --planner load "
                "with --colocated"
            )
        if self.ray.attach:
            raise ValueError("planner: --attach gateways do not own the pools; plan from the "
                             "process that starts them")  # fmt: skip

    def _check_engine_lifetime(self) -> None:
        """ValueError naming the flag when engines meant to outlive the gateway
        (``--detach-engines``, ``--attach``) could not: they need a Ray cluster
        the gateway only joins (a local Ray started by the gateway dies with it)
        and a cluster secret the next gateway can hold too."""
        flag = "--detach-engines" if self.ray.detach_engines else None
        flag = "--attach" if self.ray.attach else flag
        if flag is None:
            return
        if not (self.ray.address or os.environ.get("RAY_ADDRESS")):
            raise ValueError(
                f"{flag}: engines outlive the gateway only on a Ray cluster it joins "
                "(ray start --head, then pass --address)"
            )
        if self.security.internal_auth and not self.security.cluster_secret_file:
            raise ValueError(
                f"{flag}: pass --cluster-secret-file (the next gateway must hold the "
                "engines' secret)"
            )
