"""Per-engine scheduler: pure Python + msgspec (no torch), reusable by a simulator.

The messages it takes and gives to the gateway (``EngineRequest``,
``EngineOutputs``, ...) are the engine protocol's, ``wire/engine_protocol.py``.
"""

from scheduler.config import SchedulerConfig
from scheduler.messages import ModelRunnerOutput, SchedulerOutput
from scheduler.request import Request, RequestStatus
from scheduler.scheduler import Scheduler

__all__ = [
    "ModelRunnerOutput",
    "Request",
    "RequestStatus",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
]
