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

from tandem.scheduler.engine_stats import EngineStats, HistogramSnapshot
from tandem.wire.engine_protocol import EngineOutput, EngineRequest


class BackendUnavailable(Exception):
    """No ready engine, or the backend refuses more load. The gateway answers
    503 with this exception's message."""


class EngineMetrics(msgspec.Struct):
    """One engine as the gateway sees it at scrape time: the latest
    ``EngineStats`` it reported (all zeros until the first arrives) and the
    gateway's own view of it.

    ``state``: ``"alive"``, ``"slow"`` or ``"dead"`` (``cluster/engines/health.py``),
    ``"starting"`` before its first ``ready()``; ``epoch`` is the incarnation
    the gateway is connected to; ``num_restarts`` counts new epochs after
    the first; ``last_error`` is the latest failure the gateway saw there.
    """

    stats: EngineStats
    epoch: int = 0
    state: str = "alive"
    ready: bool = True
    num_restarts: int = 0
    last_error: str = ""
    # The router's load figures for it (cluster/routing/router.py): requests this
    # gateway sent there that have not ended, and their predicted uncached prompt
    # tokens not yet prefilled; ``peer_*`` the other gateways' sums as they last
    # published them (several gateways, cluster/routing/peer_load.py; else 0).
    num_inflight: int = 0
    queued_prefill_tokens: int = 0
    peer_inflight: int = 0
    peer_queued_prefill_tokens: int = 0

    @property
    def engine_id(self) -> str:
        return self.stats.engine_id

    @property
    def role(self) -> str:
        return self.stats.role


class PeerGateway(msgspec.Struct):
    """Another gateway whose in-flight record this one holds (not expired)."""

    index: int  # its ``--api-server-count`` index
    pid: int
    age_s: float  # since it wrote the record (wall clock; refreshed on change and every 0.5 s)
    requests_in_flight: int  # its own requests on every engine, as the record says


# Why an in-flight datagram between gateways was lost (PeerLoadStats.num_dropped):
#   bad_datagram  one received that is no peer's record (cut, checksum, a stranger, our own index)
#   send_refused  a send to a peer's socket refused (nobody reads it): that peer's counts dropped
#   queue_full    a send to a peer whose queue was full: it gets the latest at the next flush
DROP_REASONS = ("bad_datagram", "send_refused", "queue_full")


class PeerLoadStats(msgspec.Struct):
    """This gateway's end of the in-flight counts the gateways share
    (``cluster/routing/peer_load.py``): its live peers and its counters,
    cumulative since it started; ``num_dropped`` by ``DROP_REASONS``."""

    gateway: int  # this gateway's index
    expire_after_s: float  # a peer's record counts this long after it was written
    peers: list[PeerGateway] = []  # by index
    num_records_sent: int = 0
    num_records_received: int = 0
    num_records_expired: int = 0
    num_dropped: dict[str, int] = {}


class ErrorEvent(msgspec.Struct):
    """One failure worth an operator's eye: ``time_s`` is wall-clock
    (``time.time()``), ``source`` an engine id, ``"gateway"`` or ``"request"``."""

    time_s: float
    source: str
    message: str


class ScalingEvent(msgspec.Struct):
    """One engine a pool resize started or stopped (``cluster/disagg/scaling.py``),
    or one that moved into ``pool`` (``move``: ``cluster/disagg/pool_move.py``).
    ``action``: ``scale_out`` | ``scale_in`` | ``move``; ``outcome``: ``ok`` |
    ``failed`` | ``refused`` (outside the pool's min/max, or pools that cannot
    move engines); ``source``: ``admin`` or ``planner``."""

    time_s: float  # wall clock
    pool: str
    action: str
    outcome: str
    engine_id: str = ""
    detail: str = ""
    source: str = "admin"


class PlannerDecision(msgspec.Struct):
    """One pool decision of the running planner (``cluster/planner/runner.py``):
    ``action`` ``scale_out`` | ``scale_in`` | ``hold``, why, and the figures it
    decided on."""

    time_s: float
    pool: str
    action: str
    reason: str
    current: int
    target: int
    inputs: dict[str, float] = {}


class PoolMoves(msgspec.Struct):
    """Whether an engine may move between the prefill and decode pools
    (``cluster/disagg/pool_move.py``), and why not (``cluster/engines/pool_moves.py``)."""

    enabled: bool = False
    reason: str = ""


class PlannerState(msgspec.Struct):
    mode: str = "off"  # off | load | sla
    interval_s: float = 0.0
    decisions: dict[str, int] = {}  # "pool/action/reason" -> count
    recent: list[PlannerDecision] = []  # oldest first, bounded


class BackendMetrics(msgspec.Struct):
    engines: list[EngineMetrics] = []
    # Router decisions, cumulative: {"remote": n, "local": m}.
    num_disagg_decisions: dict[str, int] = {}
    # Router choices, cumulative: {"decode/prefix_hit": n, ...} (cluster/routing)
    router_decisions: dict[str, int] = {}
    # predicted - reported prefix-hit tokens per request (kv-aware routing)
    prefix_hit_error: HistogramSnapshot | None = None
    # Streams migrated off a lost/drained engine, by reason (cluster/disagg/migration.py).
    num_migrations: dict[str, int] = {}
    # The gateway's own internal-plane sockets (gateway_output), same meaning.
    malformed_frames: dict[str, int] = {}
    auth_failures: dict[str, int] = {}
    # Cumulative counts of the backend's own recoveries.
    num_streams_cut: int = 0  # streams cut: the client read too slowly
    num_orphans_aborted: int = 0  # aborts sent to an engine that came back
    num_reader_restarts: int = 0  # output reader restarted after it ended
    num_engine_restarts: int = 0  # engines that came back with a new epoch
    recent_errors: list[ErrorEvent] = []  # oldest first, bounded
    # Elastic pools (cluster/disagg/scaling.py): engines per pool now (starting
    # ones excluded), engines started/stopped by "pool/action/outcome", the
    # latest actions (oldest first), and the planner's state.
    pool_sizes: dict[str, int] = {}
    scaling_actions: dict[str, int] = {}
    scaling_events: list[ScalingEvent] = []
    planner: PlannerState | None = None
    pool_moves: PoolMoves | None = None  # None: a backend without pools
    # Several gateways: this one's share of their in-flight counts (None with one)
    peer_load: PeerLoadStats | None = None


class Backend(abc.ABC):
    """Engines behind the gateway.

    Attributes the gateway reads:
      ``model_name``      the served model id (``/v1/models``, ``model`` field)
      ``max_model_len``   prompt + generated tokens may not exceed it
      ``tokenizer``       a Hugging Face tokenizer (``workers.text.tokenizer``)
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

    def num_ready(self, request_id: str) -> int:
        """How many outputs of ``request_id`` were received and not yet taken
        from its ``generate`` iterator. Called once per output: must be a cheap
        lookup. While more are ready the gateway puts a stream's SSE events
        into one write (the same bytes; fewer writes and wake-ups when it runs
        behind its engines). The default: none, every event is its own write."""
        return 0

    @abc.abstractmethod
    async def abort(self, request_id: str) -> None:
        """Cancel a request on every engine holding it (prefill, decode, the
        handoff in between). Idempotent; unknown ids are ignored."""

    async def abort_choice(self, request_id: str, index: int) -> None:
        """Cancel one choice of an ``n > 1`` request (its stop string matched);
        the others go on. The default does nothing: the choice then runs to
        its own end and its outputs are ignored."""

    def route_log_fields(self, request_id: str) -> dict[str, Any]:
        """The router's decision for an ended request, as fields of its
        finished log line (``cluster/routing/route_log.py``); asked once,
        after the request's generator closed. The default has none."""
        return {}

    def degraded(self) -> str:
        """Non-empty while serving with less than configured (an engine
        dead or drained): ``/health`` stays 200 and reports it."""
        return ""

    async def drain(self, engine_id: str) -> dict[str, Any]:
        """Stop new work on an engine and move its streams away (admin API).
        ValueError naming ``engine_id`` if unknown."""
        raise ValueError("engine_id: this backend has no engines to drain")

    def undrain(self, engine_id: str) -> dict[str, Any]:
        """Let a drained engine take new work again."""
        raise ValueError("engine_id: this backend has no engines to drain")

    async def scale_pool(self, role: str, engines: int) -> dict[str, Any]:
        """Resize pool ``role`` to ``engines`` while serving (admin API): new
        engines join when ready, removed ones are drained first. ValueError
        naming the field when refused (no such pool, outside its
        min/max)."""
        raise ValueError("pool: this backend has no engine pools to resize")

    async def move_engine(
        self, source_pool: str, dest_pool: str, engine_id: str | None = None
    ) -> dict[str, Any]:
        """Move one engine of ``source_pool`` (``engine_id``, else the least
        loaded) to ``dest_pool`` while serving (admin API): drained first, its
        streams migrate. ValueError naming the field when refused."""
        raise ValueError("pool: this backend has no engine pools to move between")

    async def reset_prefix_cache(self) -> dict[str, bool]:
        """Every engine drops its unused cached blocks; per engine whether it
        did (admin API)."""
        return {}

    async def profile(self, start: bool) -> dict[str, Any]:
        """Start (``start``) or stop every engine's profiler trace; per engine
        True / the trace's path. ValueError when profiling is off."""
        raise ValueError("profile_dir: this backend has no engines to profile")

    @abc.abstractmethod
    def metrics_snapshot(self) -> BackendMetrics:
        """Current engine metrics; called at each ``/metrics`` scrape. Must
        not block on engines (return the latest values received)."""
