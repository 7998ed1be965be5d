"""Per-request limits at the HTTP edge, checked before any work is done.

    request arrives
      -> RequestSlots.acquire()      503 + Retry-After past --max-num-requests
      -> read_body()                 413 past --max-request-body-mb (Content-Length
                                     checked first, then bytes counted as they arrive)
      -> parse, tokenize (pool), generate under the --request-timeout-s deadline

Every refusal is a ``ProtocolError`` (the OpenAI error envelope).
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

from tandem.cluster.gateway.protocol import ProtocolError
from tandem.wire.config_fields import option

if TYPE_CHECKING:  # the serve configuration imports GatewayLimits without the web stack
    from starlette.requests import Request

MIB = 1 << 20


@dataclasses.dataclass(frozen=True)
class GatewayLimits:
    """The gateway's limits: a section of the serve configuration
    (``cluster/cli/config/``), flags and YAML keys of the same names."""

    max_request_body_mb: float = option(
        8.0, help="larger request bodies get 413, before anything is parsed"
    )
    max_num_requests: int = option(
        0, default_text="0 (no cap)", help="concurrent requests; more get 503 + Retry-After"
    )
    request_timeout_s: float = option(
        600.0,
        default_text="600 (0 = none)",
        help="per-request deadline: aborted on the engines, 504 / error event",
    )
    # threads that tokenize prompts and render chat templates (the Rust tokenizer
    # releases the GIL while it encodes)
    tokenizer_workers: int = option(2, help="threads that tokenize prompts")
    retry_after_s: int = option(1, help="the Retry-After of a 503 past --max-num-requests")
    max_logprobs: int = option(20, help="cap of logprobs / top_logprobs per token")
    max_queued_outputs: int = option(
        512,
        help="undelivered outputs of one stream before it is cut (a client not reading)",
    )

    def __post_init__(self) -> None:
        for name in ("max_request_body_mb", "request_timeout_s"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        if self.max_request_body_mb == 0:
            raise ValueError("max_request_body_mb must be > 0")
        for name in (
            "max_num_requests",
            "tokenizer_workers",
            "retry_after_s",
            "max_logprobs",
            "max_queued_outputs",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        for name in ("tokenizer_workers", "max_queued_outputs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def max_request_body_bytes(self) -> int:
        return int(self.max_request_body_mb * MIB)


class Overloaded(ProtocolError):
    """503 with a ``Retry-After`` header."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(
            message, status_code=503, type="service_unavailable", code="too_many_requests"
        )
        self.headers = {"retry-after": str(retry_after_s)}


def body_too_large(max_bytes: int) -> ProtocolError:
    return ProtocolError(
        f"The request body is larger than the limit of {max_bytes} bytes.",
        status_code=413,
        code="request_too_large",
    )


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The request body, refusing (413) as soon as it is known to exceed
    ``max_bytes``: from ``Content-Length`` before reading anything, else
    while the chunks arrive (chunked transfer encoding). Nothing is parsed."""
    # The ASGI messages read directly, as ``Request.stream`` reads them (a client gone
    # mid-body is Starlette's ``ClientDisconnect``), without its async generator and
    # header map per request; the server lower-cases header names (ASGI).
    for name, value in request.scope["headers"]:
        if name == b"content-length":
            if not value.isdigit():
                raise ProtocolError("Invalid Content-Length header.")
            if int(value) > max_bytes:
                raise body_too_large(max_bytes)
            break
    receive = request.receive
    chunks: list[bytes] = []
    num_bytes = 0
    while True:
        message = await receive()
        if message["type"] == "http.request":
            chunk = message.get("body", b"")
            num_bytes += len(chunk)
            if num_bytes > max_bytes:
                raise body_too_large(max_bytes)
            if chunk:
                chunks.append(chunk)
            if not message.get("more_body", False):
                return chunks[0] if len(chunks) == 1 else b"".join(chunks)
        elif message["type"] == "http.disconnect":
            from starlette.requests import ClientDisconnect

            raise ClientDisconnect()


class RequestSlots:
    """At most ``max_num_requests`` generation requests at once (0: no cap),
    from arrival to the end of the response. Event-loop thread only."""

    def __init__(self, max_num_requests: int, retry_after_s: int) -> None:
        self.max_num_requests = max_num_requests
        self.retry_after_s = retry_after_s
        self.num_active = 0

    def acquire(self) -> None:
        """Take a slot or raise ``Overloaded``; pair with ``release()``."""
        if self.max_num_requests and self.num_active >= self.max_num_requests:
            raise Overloaded(
                f"The server is at its limit of {self.max_num_requests} concurrent requests.",
                self.retry_after_s,
            )
        self.num_active += 1

    def release(self) -> None:
        self.num_active -= 1
