"""Per-engine scheduler: pure Python + msgspec (no torch), reusable by a simulator.

The messages it takes and gives to the gateway (``EngineRequest``,
``EngineOutputs``, ...) are the engine protocol's, ``wire/engine_protocol.py``.

May import ``wire`` only (and msgspec, numpy, xxhash): never torch, ``kernels``,
``kvtransfer`` (its connector is duck-typed), ``workers`` or ``cluster``.
"""

from tandem.scheduler.config import SchedulerConfig
from tandem.scheduler.messages import ModelRunnerOutput, SchedulerOutput
from tandem.scheduler.request import Request, RequestStatus
from tandem.scheduler.scheduler import Scheduler

__all__ = [
    "ModelRunnerOutput",
    "Request",
    "RequestStatus",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
]
