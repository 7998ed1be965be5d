"""KV transfer between engines: connector interface, NIXL connector, params.

``create_connector(KVTransferConfig(...))`` returns ``(scheduler_side,
worker_side)``; see ``base.py`` for the contract of each half.

May import ``scheduler`` (types), ``wire`` and NIXL/UCX; never ``workers`` or ``cluster``.
"""

from tandem.kvtransfer.base import KVConnectorSchedulerSide, KVConnectorWorkerSide
from tandem.kvtransfer.config import KVTransferConfig
from tandem.kvtransfer.params import KVTransferParams
from tandem.kvtransfer.registry import available_connectors, create_connector, register_connector

__all__ = [
    "KVConnectorSchedulerSide",
    "KVConnectorWorkerSide",
    "KVTransferConfig",
    "KVTransferParams",
    "available_connectors",
    "create_connector",
    "register_connector",
]
