"""Engines in their own OS processes, joined by a small ZMQ harness (no Ray).

harness PUSH --R/A/U--> engine PULL        harness PULL <--O/U-- engine PUSH

Like ``tandem serve``, the harness generates a cluster secret and every
socket uses CURVE (``wire/auth.py``); ``Harness(secret=None)`` runs plain.
"""

from __future__ import annotations

import itertools
import time
from typing import Any

import msgspec
import zmq

from tandem.cluster.engines.actor import free_port
from tandem.scheduler.engine_stats import EngineStats
from tandem.wire.auth import PlaneAuth, generate_secret
from tandem.wire.engine_protocol import (
    EngineAbort,
    EngineOutput,
    EngineOutputs,
    EngineRequest,
    UtilityCall,
    UtilityResult,
)
from tandem.workers.config import EngineConfig
from tests import forkserver

_NEW = object()


class EngineDied(RuntimeError):
    """An engine process exited while the harness waited on it."""


def _engine_main(config: EngineConfig, input_addr: str, output_addr: str) -> None:
    import torch

    torch.set_num_threads(1)
    from tandem.workers.engine.core import EngineCore
    from tandem.workers.engine.service import EngineService

    EngineService(EngineCore(config)).serve_zmq(input_addr, output_addr)


class EngineProcess:
    def __init__(self, config: EngineConfig, output_addr: str) -> None:
        self.config = config
        self.input_addr = f"tcp://127.0.0.1:{free_port()}"
        ctx = forkserver.context()  # a clean child without importing torch again
        # a daemonic process may not start children: a tensor-parallel engine's
        # workers are its children (kill() stops it; its workers follow)
        self.proc = ctx.Process(
            target=_engine_main,
            args=(config, self.input_addr, output_addr),
            daemon=config.parallel.tensor_parallel_size == 1,
        )
        self.proc.start()

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(10)


class Harness:
    """Starts engines, sends requests, collects outputs with deadlines."""

    def __init__(self, secret: bytes | None | object = _NEW) -> None:
        self.secret: bytes | None = generate_secret() if secret is _NEW else secret  # type: ignore[assignment]
        self.ctx = zmq.Context()
        self.auth = PlaneAuth(self.ctx, self.secret)
        self.output_addr = f"tcp://127.0.0.1:{free_port()}"
        self.pull = self.ctx.socket(zmq.PULL)
        self.auth.server(self.pull, "gateway_output")
        self.pull.bind(self.output_addr)
        self.engines: dict[str, EngineProcess] = {}
        self.push: dict[str, zmq.Socket] = {}
        self.outputs: dict[str, list[tuple[str, EngineOutput]]] = {}
        self.utility: dict[int, UtilityResult] = {}
        self._ids = itertools.count()
        self._enc = msgspec.msgpack.Encoder()
        self._dec_out = msgspec.msgpack.Decoder(EngineOutputs)
        self._dec_util = msgspec.msgpack.Decoder(UtilityResult)

    def start(self, name: str, config: EngineConfig, attempts: int = 3) -> None:
        """Start an engine and wait until it answers. The input port is picked
        free before the engine process binds it, seconds later; if another
        socket took it meanwhile the engine exits at bind, and a fresh port is
        tried (an engine that dies `attempts` times still fails the test)."""
        for attempt in range(attempts):
            sock = self._launch(name, config)
            try:
                self.call(name, "check_integrity", timeout_s=180)  # ready once it answers
                break
            except EngineDied:
                sock.close()
                if attempt == attempts - 1:
                    raise
        if config.kv_transfer.connector:
            self._register_prefill_engines()

    def start_all(self, configs: dict[str, EngineConfig]) -> None:
        """Start several engines at once (their loads overlap), then wait for
        each; one that died at bind (a taken port) is started again by ``start``."""
        for name, config in configs.items():
            self._launch(name, config)
        for name, config in configs.items():
            try:
                self.call(name, "check_integrity", timeout_s=180)
            except EngineDied:
                self.push[name].close()
                self.start(name, config)
        if any(c.kv_transfer.connector for c in configs.values()):
            self._register_prefill_engines()

    def _launch(self, name: str, config: EngineConfig) -> zmq.Socket:
        """Start engine ``name``'s process and connect the socket that feeds it."""
        ep = EngineProcess(
            config.replace(engine_id=name, cluster_secret=self.secret), self.output_addr
        )
        self.engines[name] = ep
        sock = self.ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        self.auth.client(sock)
        sock.connect(ep.input_addr)
        self.push[name] = sock
        return sock

    def _register_prefill_engines(self) -> None:
        """What the cluster does: tell every decode engine the prefill
        engines' side channels (D reads from nowhere else)."""
        endpoints = []
        for name, ep in self.engines.items():
            if ep.config.runtime.role == "prefill" and ep.proc.is_alive():
                host, port = self.call(name, "kv_transfer_address")
                rank_ports = self.call(name, "kv_rank_ports")
                endpoints.append(
                    [name, ep.config.runtime.epoch, host, port, *([rank_ports] * bool(rank_ports))]
                )
        for name, ep in self.engines.items():
            if ep.config.runtime.role == "decode" and ep.proc.is_alive():
                self.call(name, "set_prefill_endpoints", args=[endpoints])

    def send(self, name: str, req: EngineRequest) -> None:
        self.outputs.setdefault(req.request_id, [])
        self.push[name].send_multipart([b"R", self._enc.encode(req)])

    def abort(self, name: str, request_id: str) -> None:
        self.push[name].send_multipart([b"A", self._enc.encode(EngineAbort([request_id]))])

    def _pump(self, timeout_ms: int) -> None:
        if not self.pull.poll(timeout_ms):
            return
        while True:
            try:
                kind, payload = self.pull.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if kind == b"O":
                batch = self._dec_out.decode(payload)
                for o in batch.outputs:
                    self.outputs.setdefault(o.request_id, []).append((batch.engine_id, o))
            elif kind == b"U":  # (b"H" heartbeats are the gateway's business)
                r = self._dec_util.decode(payload)
                self.utility[r.call_id] = r

    def call(
        self, name: str, method: str, timeout_s: float = 30.0, args: list | None = None
    ) -> Any:
        cid = next(self._ids)
        call = UtilityCall(cid, method, args or [])
        self.push[name].send_multipart([b"U", self._enc.encode(call)])
        end = time.monotonic() + timeout_s
        while cid not in self.utility:
            if not self.engines[name].proc.is_alive():
                raise EngineDied(f"engine {name} died (exit {self.engines[name].proc.exitcode})")
            assert time.monotonic() < end, f"{name}.{method} timed out"
            self._pump(50)
        r = self.utility.pop(cid)
        if r.error:
            raise AssertionError(f"{name}.{method}: {r.error}")
        return r.result

    def wait_final(self, request_id: str, engine: str, timeout_s: float = 60.0) -> EngineOutput:
        end = time.monotonic() + timeout_s
        while True:
            for eid, o in self.outputs.get(request_id, []):
                if eid == engine and o.finish_reason is not None:
                    return o
            assert time.monotonic() < end, f"{request_id} did not finish on {engine}"
            self._pump(50)

    def tokens(self, request_id: str, engine: str) -> list[int]:
        return [t for eid, o in self.outputs[request_id] if eid == engine for t in o.new_token_ids]

    def stats(self, name: str) -> EngineStats:
        """The engine's ``EngineStats`` (a utility result travels untyped)."""
        return msgspec.convert(self.call(name, "stats"), EngineStats)

    def wait_idle(self, name: str, timeout_s: float = 30.0) -> EngineStats:
        end = time.monotonic() + timeout_s
        while True:
            s = self.stats(name)
            q = s.scheduler
            busy = q.num_running_reqs + q.num_waiting_reqs + q.num_waiting_for_remote_kvs
            sending = s.kv_transfer.sends_blocks_held if s.kv_transfer is not None else 0
            if not busy and not q.num_blocks_held_for_transfer and not sending:
                assert self.call(name, "check_integrity") is True
                return s
            assert time.monotonic() < end, f"{name} not idle: {s}"
            time.sleep(0.05)

    def close(self) -> None:
        for ep in self.engines.values():
            ep.kill()
        for s in self.push.values():
            s.close(0)
        self.pull.close(0)
        self.auth.close()
        self.ctx.term()
