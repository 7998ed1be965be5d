"""One engine as a Ray actor.

The actor owns an EngineCore whose loop runs on a background thread, fed by
ZMQ (the data plane). Ray method calls are control only: ``ready`` (address,
epoch), ``stats``, ``check_integrity``, ``set_prefill_endpoints``, ``set_role``,
``kv_tier_export``, ``kv_events_snapshot``, ``attach``, ``shutdown``. Each start (including a
restart by Ray after a crash) gets a new epoch, so peers and the router never
reuse state of a previous incarnation.

Gateway sessions (``cluster/engines/attach.py``): each gateway is named by
its session (a ``time_ns`` taken at its start). The engine starts with one
gateway (or none: ``--api-server-count``'s supervisor) and any number
``join``; each request names its gateway, which alone gets its outputs
(``workers/engine/gateway_outputs.py``). A gateway that is gone is dropped
by the engine with its requests; ``leave`` does the same at a normal exit.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from typing import Any

import msgspec

from tandem.wire.auth import secret_fingerprint
from tandem.workers.config import EngineConfig
from tandem.workers.parallel.connector_hook import kv_role


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def node_ip() -> str:
    if os.environ.get("TANDEM_HOST"):
        return os.environ["TANDEM_HOST"]
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - not in Ray: loopback
        return "127.0.0.1"


class EngineActor:
    """Plain class; ``cluster.engines.pools`` wraps it with ``ray.remote``."""

    def __init__(
        self,
        config: EngineConfig,
        output_addr: str,
        gateway_session: int = 0,
        model_config: dict | None = None,
    ) -> None:
        from tandem.cluster.observability.logging_setup import configure_logging
        from tandem.workers.engine.core import EngineCore
        from tandem.workers.engine.service import EngineService

        configure_logging(config.runtime.log_format)  # Ray forwards these lines to the driver
        self.epoch = time.time_ns()
        # A restart by Ray re-runs this with the arguments of the first start:
        # the gateway serving now re-attaches it (its session is newer).
        self.gateway_session = gateway_session
        self._attach_lock = threading.Lock()
        # "auto": this node's address (multi-node clusters); else as given.
        host = (
            node_ip()
            if config.kv_transfer.side_channel_host in ("", "auto", "0.0.0.0")
            else config.kv_transfer.side_channel_host
        )
        self.config = config.replace(epoch=self.epoch, kv_host=host)
        # the model's config as the gateway read it (hf_config.plain_config): this process
        # never imports transformers' configuration classes (seconds of torch imports)
        self.engine = EngineCore(self.config, model_config)
        self.service = EngineService(self.engine)
        self.input_addr = f"tcp://{host}:{free_port(host)}"
        self._thread = threading.Thread(
            target=self._serve, args=(output_addr,), name="engine-loop", daemon=True
        )
        self._thread.start()

    def _serve(self, output_addr: str) -> None:
        try:
            self.service.serve_zmq(
                self.input_addr, output_addr, gateway_session=self.gateway_session
            )
        except BaseException:  # a dead loop must not leave a live-looking actor
            os._exit(1)

    def ready(self) -> dict[str, Any]:
        import ray

        self.service.started.wait(30)  # its gateways are registered

        kv = self.engine.kv_transfer_address()
        return {
            "engine_id": self.config.runtime.engine_id,
            "role": self.config.runtime.role,
            "epoch": self.epoch,
            "input_addr": self.input_addr,
            "max_model_len": self.engine.max_model_len,
            "max_num_seqs": self.config.scheduler.max_num_seqs,
            "num_kv_blocks": self.engine.sched_config.num_kv_blocks,
            "kv_address": list(kv) if kv else None,
            # "prefill" serves KV, "decode" reads peers', "both" (a host KV tier) does both
            "kv_role": kv_role(self.config) if self.config.kv_transfer.connector else None,
            "kv_rank_ports": self.engine.kv_rank_ports(),
            "tp_worker_pids": [p.pid for p in self.engine.tp.procs] if self.engine.tp else [],
            # rank 1.. worker actors (workers/parallel/ray_workers.py): name, placement
            "tp_worker_actors": [
                p.describe()
                for p in (self.engine.tp.procs if self.engine.tp else [])
                if hasattr(p, "describe")
            ],
            "block_size": self.config.cache.block_size,
            "prefix_caching_hash_algo": self.config.cache.prefix_caching_hash_algo,
            "kv_events_addr": self.engine.kv_publisher.addr if self.engine.kv_publisher else None,
            "pid": os.getpid(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "model": self.config.model.name,
            "gateway_session": self.gateway_session,
            "gateways": list(self.service.gateway_sessions),  # a snapshot, any thread
            "serving": self.service.serving,  # False once its loop has ended
            "secret_fingerprint": secret_fingerprint(self.config.runtime.cluster_secret),
        }

    def join(self, output_addr: str, gateway_session: int) -> dict[str, Any]:
        """Gateway ``gateway_session`` serves from this engine too (several
        gateways over one fleet; ``cluster/engines/attach.py``): outputs of
        the requests it sends go to ``output_addr``; the other gateways keep
        theirs. Returns ``ready()``'s answer plus ``num_aborted`` (0: joining
        aborts nothing; a gateway that is gone is dropped by the engine)."""
        with self._attach_lock:
            self.service.call_in_loop(
                lambda: self.service.join_gateway(output_addr, gateway_session)
            )
            self.gateway_session = max(self.gateway_session, gateway_session)
            return {**self.ready(), "num_aborted": 0}

    # the name of the single-gateway adoption (``tandem serve --attach``)
    attach = join

    def leave(self, gateway_session: int) -> int:
        """Gateway ``gateway_session`` exits normally: its requests are
        aborted here and it gets no more outputs. Returns how many."""
        with self._attach_lock:
            return self.service.call_in_loop(lambda: self.service.leave_gateway(gateway_session))

    def set_role(self, role: str) -> dict[str, Any]:
        """Serve in the ``role`` pool from now on (a pool move,
        ``cluster/disagg/pool_move.py``): refused with a ValueError naming ``role``
        while the engine holds a request, or when it was not started for moves
        (``EngineCore.set_role``). Returns ``ready()``'s answer under the new role.
        A restart by Ray starts it in its first pool again: the gateway moves it
        back (``cluster/disagg/membership.py``)."""
        with self._attach_lock:
            self.service.call_in_loop(lambda: self.engine.set_role(role))
            self.config = self.config.replace(role=role)
            return self.ready()

    def stats(self) -> bytes:
        """The engine's ``EngineStats``, msgpack-encoded: the gateway decodes
        and validates it like a frame of its sockets."""
        return msgspec.msgpack.encode(self.service.call_in_loop(self.service.stats))

    def check_integrity(self) -> bool:
        return self.service.call_in_loop(self.service.check_integrity)

    def set_prefill_endpoints(self, endpoints: list[list[Any]]) -> bool:
        """Control call from the cluster: the registered prefill engines'
        ``[engine_id, epoch, host, port]``; D reads KV only from these."""
        return self.service.call_in_loop(lambda: self.engine.set_prefill_endpoints(endpoints))

    def kv_tier_export(self, block_hashes: list[bytes]) -> dict[str, Any] | None:
        """Lend the leading ``block_hashes`` this engine's host KV tier holds to a
        peer's NIXL READ (``kvtransfer/tiers/export.py``): the reading request's
        ``kv_transfer_params``, or None when the tier holds none of them."""
        return self.service.call_in_loop(lambda: self.engine.kv_tier_export(block_hashes))

    def kv_events_snapshot(self) -> Any:
        """The engine's cached hashes as of its last KV event batch (resync)."""
        return self.service.call_in_loop(self.engine.kv_events_snapshot)

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block no request uses (KV events tell the
        routers); False if blocks were in use (those stay)."""
        return self.service.call_in_loop(self.engine.reset_prefix_cache)

    def start_profile(self) -> bool:
        """Begin a torch profiler trace (``workers/engine/profiling.py``);
        ValueError when the engine has no ``profile_dir``."""
        return self.service.call_in_loop(self.service.profiler.start)

    def stop_profile(self) -> str | None:
        """End the trace; the path of the file written."""
        return self.service.call_in_loop(self.service.profiler.stop, timeout_s=120.0)

    def shutdown(self) -> None:
        self.service.shutdown()
        self._thread.join(timeout=10)
