"""Connector registry: a name in ``KVTransferConfig.connector`` -> a factory.

Factories are imported lazily so that ``import kvtransfer`` stays light
(no torch, no NIXL) until a connector is actually built.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable

from tandem.kvtransfer.base import KVConnectorSchedulerSide, KVConnectorWorkerSide
from tandem.kvtransfer.config import KVTransferConfig

ConnectorPair = tuple[KVConnectorSchedulerSide, KVConnectorWorkerSide]
ConnectorFactory = Callable[[KVTransferConfig], ConnectorPair]

# name -> "module:function"
_REGISTRY: dict[str, str] = {"nixl": "tandem.kvtransfer.registry:create_nixl_connector"}


def register_connector(name: str, factory_path: str) -> None:
    """Add a connector under ``name``; ``factory_path`` is ``"module:function"``."""
    _REGISTRY[name] = factory_path


def available_connectors() -> list[str]:
    return sorted(_REGISTRY)


def create_connector(config: KVTransferConfig) -> ConnectorPair:
    """Build ``(scheduler_side, worker_side)`` for ``config.connector``."""
    path = _REGISTRY.get(config.connector)
    if path is None:
        raise ValueError(
            f"unknown KV connector {config.connector!r}; available: {available_connectors()}"
        )
    module_name, _, function_name = path.partition(":")
    factory: ConnectorFactory = getattr(importlib.import_module(module_name), function_name)
    return factory(config)


def create_nixl_connector(config: KVTransferConfig) -> ConnectorPair:
    """The worker side binds the side channel (``side_channel_port=0`` picks a
    port; the cluster reads it back from ``worker.side_channel_port``)."""
    from tandem.kvtransfer.nixl_scheduler import NixlSchedulerSide
    from tandem.kvtransfer.nixl_worker import NixlWorkerSide

    worker = NixlWorkerSide(config)
    port = worker.side_channel_port
    scheduler_config = dataclasses.replace(config, side_channel_port=port or 0)
    return NixlSchedulerSide(scheduler_config), worker
