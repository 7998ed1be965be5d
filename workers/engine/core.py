"""EngineCore: one engine's loop, ``schedule() -> execute() -> update_from_output()``.

``add_request`` / ``abort`` / ``step`` from one thread at a time: in process
(``workers/engine/llm.py``), or the loop thread of an ``EngineService``
(``service.py``), which feeds it from the engine's sockets. No sockets here
beyond the KV events publisher and the connector's side channel.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import msgspec

from tandem.kvtransfer.ucx.proto_info import stats_fields as transport_fields
from tandem.scheduler import Request, RequestStatus, Scheduler
from tandem.scheduler.async_scheduler import AsyncScheduler
from tandem.scheduler.engine_stats import EngineStats, Histogram, KVTransferStats, WireStats
from tandem.scheduler.kv_events import KVEventRecorder, KVSnapshot
from tandem.wire.engine_protocol import EngineOutput, EngineOutputs, EngineRequest, FinishReason
from tandem.workers.config import EngineConfig
from tandem.workers.engine.kv_events_publisher import KVEventPublisher
from tandem.workers.engine.pool_role import switch_role
from tandem.workers.engine.request_clock import RequestClock
from tandem.workers.engine.startup import (
    build_runner,
    load_engine_model,
    make_connector,
    scheduler_config,
    size_kv_cache,
)
from tandem.workers.runner.async_step import OverlappedLoop
from tandem.workers.runner.device_memory import log_share_held
from tandem.workers.structured.manager import structured_manager

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig, model_config: dict | None = None) -> None:
        """``model_config``: the model's config as plain attributes, when the caller read it
        already (``workers.checkpoints.hf_config.plain_config``: the gateway sends it to
        engine actors); None reads it from the model directory."""
        self.config = config
        loaded = load_engine_model(config, model_config)
        self.model_path, self.model, self.hf_config = (
            loaded.model_path,
            loaded.model,
            loaded.hf_config,
        )
        self.tp: Any = loaded.tp  # workers.parallel.executor.TPExecutor with TP > 1
        self.dtype = loaded.dtype
        self.eos_token_id = loaded.eos_token_id
        self.extra_eos_ids = loaded.extra_eos_ids
        # the connector first: its NIXL agent's device memory (UCX's, outside torch) is then
        # the process's when the KV cache is sized from the share (workers/runner/device_memory.py)
        self.connector_scheduler, self.connector_worker = make_connector(config, self.hf_config)
        cache = size_kv_cache(config, loaded)
        self.max_model_len = cache.max_model_len
        self.compile_report = cache.compile_report
        self.step_memory = cache.step_memory
        self.kv_cache = cache.kv_cache
        self.sched_config = scheduler_config(config, cache.num_blocks, cache.max_model_len)
        # overlapped loop (workers/runner/async_step.py); TP ranks step in lockstep: synchronous.
        # Speculative decoding runs the synchronous loop too (workers/runner/spec_step.py).
        self.speculating = config.scheduler.speculative_config is not None
        overlap = config.uses_async_scheduling() and self.tp is None and not self.speculating
        if self.speculating and config.uses_async_scheduling():
            logger.warning(
                "engine %s: speculative_config runs the synchronous loop; async_scheduling "
                "is off for this engine",
                config.runtime.engine_id,
            )
        scheduler_cls = AsyncScheduler if overlap else Scheduler
        self.structured = structured_manager(
            self.model_path,
            self.model.vocab_size,
            [self.eos_token_id, *self.extra_eos_ids],
            compile_timeout_s=config.scheduler.structured_outputs_compile_timeout_s,
        )
        self.scheduler = scheduler_cls(
            self.sched_config, self.connector_scheduler, config.runtime.engine_id, self.structured
        )
        self.kv_events: KVEventRecorder | None = None
        self.kv_publisher: KVEventPublisher | None = None
        if config.kv_transfer.kv_events:  # scheduler/kv_events.py: only when routing needs them
            self.kv_events = KVEventRecorder(
                config.runtime.engine_id, config.runtime.epoch, config.cache.block_size
            )
            self.scheduler.kv.pool.events = self.kv_events
            self.kv_publisher = KVEventPublisher(
                config.kv_transfer.side_channel_host,
                config.kv_transfer.kv_events_port,
                config.runtime.cluster_secret,
                config.kv_transfer.kv_events_queue_batches,
            )
        attach = getattr(self.connector_scheduler, "attach", None)
        if attach is not None:  # KV tiers (kvtransfer/tiers/) follow the pool's blocks
            attach(self.scheduler.kv.pool)
        self.graphs, self.runner = build_runner(
            config, loaded, cache, self.connector_worker, overlap
        )
        self.overlap = OverlappedLoop(self.scheduler, self.runner) if overlap else None
        log_share_held(loaded.device, config.cache.gpu_memory_utilization)
        self.num_steps = 0
        self.last_step_s = 0.0
        self.last_step_num_tokens = 0
        self._transfer_seconds = Histogram(
            (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
        )
        self.request_clock = RequestClock(
            config.runtime.engine_id, config.runtime.epoch, config.runtime.role
        )

    # ---- requests and steps ----------------------------------------------------

    def add_request(self, req: EngineRequest) -> EngineOutput | None:
        """Queue a request; on bad input return an error output instead of raising."""
        try:
            sp = req.sampling_params
            if self.extra_eos_ids:
                sp = msgspec.structs.replace(
                    sp, stop_token_ids=list(sp.stop_token_ids) + self.extra_eos_ids
                )
            request = Request.from_engine_request(req, self.eos_token_id)
            request.sampling_params = sp
            vocab = self.model.vocab_size
            bad = next((t for t in request.prompt_token_ids if not 0 <= t < vocab), None)
            if bad is not None:
                raise ValueError(
                    f"prompt_token_ids contains {bad}, outside the vocabulary [0, {vocab})"
                )
            self.scheduler.add_request(request)
            self.request_clock.received(req.request_id)
        except ValueError as exc:
            return EngineOutput(
                request_id=req.request_id, finish_reason=FinishReason.ERROR, error=str(exc)
            )
        return None

    def abort(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        self.request_clock.forget(request_ids)

    def unfinished_requests(self) -> list[Request]:
        return [r for r in self.scheduler.requests.values() if not r.is_finished]

    def step(self) -> EngineOutputs:
        self.num_steps += 1
        start_s = step_start = self.request_clock.clock()
        if self.overlap is not None:
            so, outputs = self.overlap.step()
        else:
            so = self.scheduler.schedule()
            outputs = self.scheduler.update_from_output(so, self.runner.execute(so))
        self.last_step_num_tokens = so.total_num_scheduled_tokens
        self.last_step_s = time.perf_counter() - start_s
        drain = getattr(self.connector_worker, "drain_load_records", None)
        self.request_clock.after_step(
            step_start,
            so,
            outputs.outputs,
            self.scheduler.waiting_for_remote,
            drain() if drain is not None else (),
        )
        self.publish_kv_events()
        return outputs

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def release_idle_memory(self) -> None:
        """Between steps while there is no work (the service loop calls it)."""
        self.runner.release_idle_memory()

    # ---- KV events -------------------------------------------------------------

    def publish_kv_events(self) -> None:
        """Send the cache changes since the last call as one batch (loop thread)."""
        if self.kv_events is not None and self.kv_publisher is not None:
            batch = self.kv_events.drain(time.time())
            if batch is not None:
                self.kv_publisher.publish(batch)

    def kv_events_snapshot(self) -> KVSnapshot:
        """Every cached hash as of the last batch published (loop thread):
        a subscriber that saw a seq gap resyncs from this."""
        if self.kv_events is None:
            raise ValueError(f"engine {self.config.runtime.engine_id} runs without kv_events")
        self.publish_kv_events()
        return self.kv_events.snapshot(list(self.scheduler.kv.pool.cached))

    def reset_prefix_cache(self) -> bool:
        """Drop the cached blocks no request holds: the device's, and with KV tiers the
        tiers' (False, nothing dropped, while a request holds blocks)."""
        done = self.scheduler.reset_prefix_cache()
        tiers = getattr(self.connector_worker, "store", None)  # KV tiers (kvtransfer/tiers/)
        if done and tiers is not None:
            tiers.reset()
        self.publish_kv_events()
        return done

    def set_role(self, role: str) -> None:
        """Serve in the ``role`` pool from now on, while idle (``pool_role.py``)."""
        switch_role(self, role)

    # ---- state and stats -------------------------------------------------------

    def check_integrity(self) -> bool:
        self.scheduler.check_integrity()
        assert self.request_clock.role == self.config.runtime.role, "role changed halfway"
        if self.tp is not None:
            self.tp.check_integrity(idle=not self.scheduler.requests)
        self.request_clock.check_integrity(self.scheduler.requests)
        drafter = getattr(self.runner, "drafter", None)  # draft model: its KV bookkeeping
        if drafter is not None:
            drafter.check(self.runner.requests, self.scheduler.running)
        tiers = getattr(self.connector_worker, "store", None)  # KV tiers (kvtransfer/tiers/)
        if tiers is not None:
            idle = not self.scheduler.requests
            self.connector_scheduler.check_integrity(idle)
            tiers.check_integrity(idle)
        return True

    def stats(self) -> EngineStats:
        """This engine now (``scheduler/engine_stats.py``); a service adds its
        sockets' counts (``EngineService.stats``). Loop thread only."""
        w = self.connector_worker
        tiers = getattr(w, "store", None)  # KV tiers (kvtransfer/tiers/): their own stats
        peer = w if tiers is None else getattr(w, "peer", None)  # NIXL, also beside tiers
        kv = self._kv_stats(peer) if peer is not None else None
        return EngineStats(
            engine_id=self.config.runtime.engine_id,
            role=self.config.runtime.role,
            epoch=self.config.runtime.epoch,
            num_steps=self.num_steps,
            last_step_s=self.last_step_s,
            last_step_num_tokens=self.last_step_num_tokens,
            scheduler=self.scheduler.make_stats(),
            num_transfers_in_flight=kv.loads_in_flight if kv is not None else 0,
            kv_transfer=kv,
            kv_offload=(
                tiers.report(len(self.connector_scheduler.loading)) if tiers is not None else None
            ),
            wire=self.wire_stats(),
            structured=self.structured.make_stats(),
        )

    def wire_stats(self) -> WireStats:
        """Dropped malformed messages and refused handshakes of the
        connector's side channel, per socket name."""
        connector = getattr(self.connector_worker, "wire_stats", None)
        if connector is None:
            return WireStats()
        extra = connector()
        return WireStats(
            malformed_frames=dict(extra["malformed_frames"]),
            auth_failures=dict(extra["auth_failures"]),
        )

    def _kv_stats(self, w: Any) -> KVTransferStats:
        raw = w.stats()
        if self.tp is not None:  # bytes and descriptors of every rank's reads
            raw = self.tp.sum_kv_stats(raw)
        for seconds in w.drain_transfer_seconds():
            self._transfer_seconds.observe(seconds)
        return KVTransferStats(
            transfer_bytes_total=raw.get("kv_transfer_bytes_total", 0.0),
            transfer_descriptors_total=raw.get("num_descriptors", 0.0),
            transfer_failures_total=raw.get("num_failures", 0.0),
            notification_failures_total=raw.get("num_notif_failures", 0.0),
            lease_expiries_total=raw.get("num_lease_expiries", 0.0),
            quarantined_loads_total=raw.get("num_quarantined_loads_total", 0.0),
            loads_in_flight=int(raw.get("num_loads_in_flight", 0)),
            loads_in_quarantine=int(raw.get("num_loads_quarantined", 0)),
            sends_blocks_held=max(
                int(raw.get("num_blocks_held_for_transfer", 0)),
                # the scheduler side counts a hold from the moment it is made (a KV tier
                # export, before the next step hands it to the worker)
                int(getattr(self.connector_scheduler, "num_blocks_held_for_transfer", 0)),
            ),
            transfer_seconds=self._transfer_seconds.snapshot(),
            **transport_fields(getattr(w, "transport_report", lambda: None)()),
        )

    # ---- KV transfer -----------------------------------------------------------

    def set_prefill_endpoints(self, endpoints: list[Any]) -> bool:
        """The prefill engines this engine may read KV from, as the cluster
        registered them: ``[engine_id, epoch, host, port]`` each, the whole
        list every time (``kvtransfer/prefill_registry.py``). Loop thread only
        (``EngineService.call_in_loop``). Raises ``ValueError`` on a bad entry."""
        setter = getattr(self.connector_scheduler, "set_prefill_endpoints", None)
        if setter is None:
            raise ValueError(
                f"engine {self.config.runtime.engine_id} has no KV connector that reads"
            )
        setter(endpoints)
        return True

    def kv_tier_export(self, block_hashes: list[bytes]) -> dict[str, Any] | None:
        """Lend the leading ``block_hashes`` this engine's host KV tier holds to another
        engine's NIXL READ (kvtransfer/tiers/export.py): the ``kv_transfer_params`` for
        that engine's request, or None when the tier holds none of them."""
        export = getattr(self.connector_scheduler, "export_host_prefix", None)
        if export is None:
            raise ValueError(
                f"engine {self.config.runtime.engine_id} has no host KV tier beside a NIXL connector "
                "(--kv-offloading-size with kv_connector nixl)"
            )
        return export([bytes(h) for h in block_hashes])

    def kv_transfer_address(self) -> tuple[str, int] | None:
        port = getattr(self.connector_worker, "side_channel_port", None)  # none: KV tiers only
        if not port:
            return None
        return (self.config.kv_transfer.side_channel_host, port)

    def kv_rank_ports(self) -> list[int]:
        """Every tensor-parallel rank's side-channel port, rank 0's first
        (``[]`` with one rank or no side channel): a prefill endpoint's ``rank_ports``."""
        address = self.kv_transfer_address()
        if self.tp is None or address is None:
            return []
        return [address[1], *self.tp.worker_kv_ports]

    # ---- shutdown --------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop everything; not while another thread steps this engine
        (``EngineService.shutdown`` stops its loop instead)."""
        self.stop_side_services()
        self.release_step_resources()

    def stop_side_services(self) -> None:
        """The KV events publisher and the connector; from any thread."""
        self.structured.shutdown()
        if self.kv_publisher is not None:
            self.kv_publisher.close()
        if self.connector_worker is not None:
            self.connector_worker.shutdown()

    def release_step_resources(self) -> None:
        """The TP workers and the overlapped runner; from the thread that
        steps (it owns the TP sockets)."""
        if self.tp is not None:
            self.tp.shutdown()
        if self.overlap is not None:
            self.runner.close()
