"""Per-engine scheduler: pure Python + msgspec (no torch), reusable by a simulator."""

from scheduler.config import SchedulerConfig
from scheduler.messages import (
    EngineOutput,
    EngineOutputs,
    EngineRequest,
    FinishReason,
    ModelRunnerOutput,
    SamplingParams,
    SchedulerOutput,
)
from scheduler.request import Request, RequestStatus
from scheduler.scheduler import Scheduler

__all__ = [
    "EngineOutput",
    "EngineOutputs",
    "EngineRequest",
    "FinishReason",
    "ModelRunnerOutput",
    "Request",
    "RequestStatus",
    "SamplingParams",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
]
