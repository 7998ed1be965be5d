"""The KV connector interface: how an engine exchanges paged KV with peers.

A connector has two halves that live in the same engine process:

* the **scheduler side** runs inside ``Scheduler`` calls, on the engine loop
  thread. It decides which tokens' KV will arrive from elsewhere, remembers
  what to load/send, and packs that into a metadata object once per step.
  It never touches KV memory and never blocks (no network I/O).
* the **worker side** runs next to the KV cache (the model runner). It
  registers the KV memory, starts transfers described by the metadata and
  reports which requests finished sending or receiving. It never blocks the
  loop either: transfers and handshakes progress in the background.

Per step::

    Scheduler.schedule()
        get_num_new_matched_tokens / update_state_after_alloc (per new request)
        build_connector_meta(scheduler_output)  -> scheduler_output.kv_connector_metadata
    ModelRunner.execute(scheduler_output)
        start_load_kv(meta); ...forward...; get_finished(); get_block_ids_with_load_errors()
        -> ModelRunnerOutput.kv_connector_output
    Scheduler.update_from_output(...)
        update_connector_output(kv_connector_output)
        request_finished(request, block_ids) for each finished request
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tandem.scheduler.messages import KVConnectorOutput, SchedulerOutput
    from tandem.scheduler.request import Request


class KVConnectorSchedulerSide(abc.ABC):
    """Scheduler half. Called only from the engine loop thread."""

    @abc.abstractmethod
    def get_num_new_matched_tokens(
        self, request: Request, num_local_computed_tokens: int
    ) -> tuple[int, bool]:
        """How many tokens past ``num_local_computed_tokens`` can be loaded
        from outside, and whether that load is asynchronous.

        Called by the scheduler when it considers a WAITING request, every
        time it considers it (the answer may change, e.g. after a local
        prefix-cache hit). Must be idempotent; it may remember the request
        (e.g. to renew the peer's lease while the request waits for free
        blocks). Returns ``(0, False)`` for a request with nothing external.
        """

    @abc.abstractmethod
    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None:
        """Called once blocks for the request (local hit + external tokens)
        are allocated. ``block_ids`` is the request's whole block table;
        ``num_external_tokens`` is what the previous call promised (0 means
        nothing to load, but the connector may still need to notify the
        peer, e.g. to free its blocks after a full local hit)."""

    @abc.abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> Any:
        """Pack the work recorded since the last call (loads to start,
        requests to send, leases to renew) into an opaque object for the
        worker side, and reset that per-step state. Called once per
        ``schedule()``, also when nothing was scheduled."""

    @abc.abstractmethod
    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Called when a request finishes (any reason, including abort)
        before its blocks are freed. Returns ``(delay_free, params)``:
        ``delay_free=True`` means the scheduler keeps the blocks until the
        worker side reports the request in ``finished_sending``; ``params``
        go back to the client (the prefill side's KVTransferParams)."""

    def cancel_send(self, request_id: str) -> None:
        """The scheduler freed a request's held blocks early (abort of a
        request whose KV was waiting to be pulled): forget the send so the
        worker side stops tracking it. No-op for unknown ids."""

    @abc.abstractmethod
    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Called with every worker output, before the scheduler acts on
        ``finished_sending`` / ``finished_recving``."""

    def has_pending_work(self) -> bool:
        """True while sends are held or loads are in flight: the engine loop
        must keep stepping (to poll the worker side) even with no request
        to schedule."""
        return False


class KVConnectorWorkerSide(abc.ABC):
    """Worker half. Called only from the thread that runs the model."""

    @abc.abstractmethod
    def register_kv_caches(self, kv_cache: Any) -> None:
        """Register the engine's KV cache (a tensor in blocks-first layout
        ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]``)
        once, before the first step."""

    @abc.abstractmethod
    def start_load_kv(self, metadata: Any) -> None:
        """Start the loads and record the sends described by ``metadata``.
        Must return without waiting for any transfer or handshake."""

    @abc.abstractmethod
    def get_finished(self) -> tuple[set[str], set[str]]:
        """``(done_sending, done_recving)`` request ids since the last call.
        A request whose load failed is still reported in ``done_recving``;
        its blocks are reported by ``get_block_ids_with_load_errors``. A
        send whose lease expired is reported in ``done_sending``."""

    @abc.abstractmethod
    def get_block_ids_with_load_errors(self) -> set[int]:
        """Local block ids whose load failed since the last call."""

    def stats(self) -> dict[str, float]:
        """Cumulative counters: bytes, seconds, descriptors, failures, ..."""
        return {}

    def shutdown(self) -> None:
        """Release the agent, registered memory and sockets. Idempotent."""
