"""A NullBackend that keeps every EngineRequest it was given, for gateway
tests that check what reaches the engines."""

from __future__ import annotations

from tandem.cluster.gateway.null_backend import NullBackend
from tandem.wire.engine_protocol import EngineRequest


class RecordingBackend(NullBackend):
    """NullBackend that keeps every EngineRequest it was given (``requests``)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.requests: list[EngineRequest] = []

    def generate(self, request: EngineRequest):
        self.requests.append(request)
        return super().generate(request)
