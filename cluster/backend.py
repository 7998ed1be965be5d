"""What the gateway needs from whatever runs the engines.

The gateway validates and tokenizes a request, then talks to one ``Backend``:
the Ray pools + router + ZMQ data plane in production, ``NullBackend`` in
gateway tests and the gateway-overhead benchmark.

    gateway --EngineRequest--> Backend.generate() --EngineOutput*--> gateway
    gateway --abort(request_id)--> Backend   (client gone, stop string matched)
    gateway /metrics --scrape--> Backend.metrics_snapshot()

All methods are called on the gateway's event loop thread.
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator
from typing import Any

import msgspec

from scheduler.messages import EngineOutput, EngineRequest, SchedulerStats


class BackendUnavailable(Exception):
    """No ready engine, or the backend refuses more load. The gateway answers
    503 with this exception's message."""


class HistogramSnapshot(msgspec.Struct):
    """A cumulative histogram as an engine exports it.

    ``bucket_counts[i]`` counts observations ``<= bucket_upper_bounds[i]``
    (cumulative, like Prometheus); the ``+Inf`` bucket is ``count``.
    """

    bucket_upper_bounds: list[float]
    bucket_counts: list[int]
    count: int = 0
    sum: float = 0.0


class EngineMetrics(msgspec.Struct):
    """One engine's metrics at scrape time.

    ``counters`` / ``gauges`` / ``histograms`` carry extra metrics (mostly the
    KV connector's) by name without the ``tandem:`` prefix, e.g.
    ``"kv_transfer_bytes_total"``, ``"kv_blocks_held_for_transfer"``,
    ``"kv_transfer_seconds"``. Counters are cumulative since engine start.
    """

    engine_id: str
    role: str  # "prefill", "decode" or "colocated"
    scheduler_stats: SchedulerStats = msgspec.field(default_factory=SchedulerStats)
    counters: dict[str, float] = {}
    gauges: dict[str, float] = {}
    histograms: dict[str, HistogramSnapshot] = {}
    # Internal-plane sockets of this engine (engine_input, kv_side_channel,
    # kv_handshake_reply): dropped malformed messages and refused handshakes.
    malformed_frames: dict[str, int] = {}
    auth_failures: dict[str, int] = {}


class BackendMetrics(msgspec.Struct):
    engines: list[EngineMetrics] = []
    # Router decisions, cumulative: {"remote": n, "local": m}.
    num_disagg_decisions: dict[str, int] = {}
    # Router choices, cumulative: {"decode/prefix_hit": n, ...} (cluster/kv_routing)
    router_decisions: dict[str, int] = {}
    # predicted - reported prefix-hit tokens per request (kv-aware routing)
    prefix_hit_error: HistogramSnapshot | None = None
    # The gateway's own internal-plane sockets (gateway_output), same meaning.
    malformed_frames: dict[str, int] = {}
    auth_failures: dict[str, int] = {}


class Backend(abc.ABC):
    """Engines behind the gateway.

    Attributes the gateway reads:
      ``model_name``      the served model id (``/v1/models``, ``model`` field)
      ``max_model_len``   prompt + generated tokens may not exceed it
      ``tokenizer``       a Hugging Face tokenizer (``workers.tokenizer``)
      ``eos_token_id``    informational; EOS stopping is the engines' job
    """

    model_name: str
    max_model_len: int
    tokenizer: Any
    eos_token_id: int | None

    @abc.abstractmethod
    def is_ready(self) -> tuple[bool, str]:
        """``(True, "")`` when every pool has a ready engine, else
        ``(False, reason)``. Cheap; called by every ``/health`` probe."""

    @abc.abstractmethod
    def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        """Run one request; an async generator of its outputs.

        Contract:
        - Raises ``BackendUnavailable`` before yielding anything when no engine
          can take the request (the gateway answers 503).
        - Yields ``EngineOutput`` for ``request.request_id`` in order; the last
          one has ``finish_reason`` set, and nothing follows it. With
          ``request.n > 1`` each output names its choice (``index``); every
          choice finishes once and the generator ends after the last one (an
          ERROR output ends it at once).
        - An output with ``finish_reason`` STOP (EOS or a stop token id) carries
          that stop token as the last of its ``new_token_ids``; the gateway
          counts it but does not detokenize it.
        - Under P/D, the first token-bearing output is the prefill engine's
          and carries its ``kv_transfer_params`` (the gateway labels the
          request's latencies ``path="remote"``); any other output has none.
        - An engine/transfer failure is a final output with ``finish_reason``
          ERROR and ``error`` text, never an exception and never silent garbage.
        - If the consumer stops iterating early (``aclose()``), the gateway
          also calls ``abort``; the generator's cleanup must not block.
        - A backend that buffers outputs may bound the buffer: when the
          consumer falls that far behind (a client that does not read), it
          aborts the request and cancels the task iterating the generator,
          as a client disconnect would.
        """

    @abc.abstractmethod
    async def abort(self, request_id: str) -> None:
        """Cancel a request on every engine holding it (prefill, decode, the
        handoff in between). Idempotent; unknown ids are ignored."""

    async def abort_choice(self, request_id: str, index: int) -> None:
        """Cancel one choice of an ``n > 1`` request (its stop string matched);
        the others go on. The default does nothing: the choice then runs to
        its own end and its outputs are ignored."""

    @abc.abstractmethod
    def metrics_snapshot(self) -> BackendMetrics:
        """Current engine metrics; called at each ``/metrics`` scrape. Must
        not block on engines (return the latest values received)."""
