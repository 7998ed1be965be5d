"""The seam where a tensor-parallel rank gets its own KV connector worker side.

Rank 0 lives in the engine core process and keeps the engine's connector
pair (``EngineCore._make_connector``): its scheduler side plans transfers for
the whole engine, its worker side moves rank 0's KV shard. Every other rank
``r`` builds its own worker side in its process, next to its KV shard::

    engine core (rank 0)                       worker process (rank r > 0)
    connector scheduler side -> metadata       make_rank_connector(config, r)
    connector worker side (rank 0's shard)     .register_kv_caches(kv shard r)
        start_load_kv(meta) / get_finished()   .start_load_kv(same meta) / get_finished()
                 \\___ ConnectorOutputMerger (kvtransfer/tp_outputs.py) ___/
                      a request is done when every rank reported it

The per-rank factory belongs to ``kvtransfer``: ``kvtransfer.registry``
provides ``create_rank_worker_side(config: EngineConfig, rank: int)``
returning a ``KVConnectorWorkerSide`` with a ``metadata_type`` attribute
(the msgspec type of its connector metadata, which crosses to the worker as
plain data). Until it exists, an engine with a KV connector and
``tensor_parallel_size > 1`` is refused at start (``check_rank_connector``).
"""

from __future__ import annotations

from typing import Any

from workers.config import EngineConfig


def _factory() -> Any:
    try:
        from kvtransfer import registry
    except ImportError:  # pragma: no cover - kvtransfer ships with workers
        return None
    return getattr(registry, "create_rank_worker_side", None)


def check_rank_connector(config: EngineConfig) -> None:
    """``ValueError`` when ranks > 0 would need a connector nobody can build."""
    if config.kv_connector and config.tensor_parallel_size > 1 and _factory() is None:
        raise ValueError(
            f"kv_connector {config.kv_connector!r} with tensor_parallel_size "
            f"{config.tensor_parallel_size}: this build has no per-rank KV connector "
            "(kvtransfer.registry.create_rank_worker_side)"
        )


def make_rank_connector(config: EngineConfig, rank: int) -> Any:
    """Rank ``rank``'s connector worker side, or None without a connector."""
    if not config.kv_connector:
        return None
    factory = _factory()
    if factory is None:
        check_rank_connector(config)
    return factory(config, rank)
