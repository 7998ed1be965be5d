"""The gateways one engine serves, seen from its loop: which gateway owns
each request, where each output goes, and what happens to a gateway's
requests when it leaves, is replaced, is gone, or stops reading.

``GatewayOutputs`` (``gateway_outputs.py``) holds the sockets and their
send queues; this module holds the engine-side decisions over them
(``EngineService`` runs both on its loop thread). Every method here runs
on the loop thread, except ``snapshot``, which any thread may read.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import msgspec

from tandem.wire.engine_protocol import (
    EngineHeartbeat,
    EngineOutput,
    EngineOutputs,
    EngineRequest,
    FinishReason,
)
from tandem.workers.engine.core import EngineCore
from tandem.workers.engine.gateway_outputs import GatewayOutputs

logger = logging.getLogger(__name__)


class GatewaySessions:
    """Request ownership and gateway membership for one engine."""

    def __init__(self, engine: EngineCore) -> None:
        self.engine = engine
        self.engine_id = engine.config.runtime.engine_id
        self.outs: GatewayOutputs | None = None  # while the service's loop runs
        self._enc = msgspec.msgpack.Encoder()
        self.num_streams_cut = 0
        self.num_unroutable = 0  # requests naming a gateway that had not joined
        self.num_gateways_lost = 0  # gateways dropped because they were gone
        self.num_gateway_requests_aborted = 0  # requests of dropped gateways

    # ---- requests and outputs ------------------------------------------------------

    def add_request(self, req: EngineRequest, errors: list[EngineOutput]) -> None:
        """Queue ``req`` for the gateway it names (its return address)."""
        if self.outs.own(req.request_id, req.gateway) is None:
            self.num_unroutable += 1
            logger.warning(
                "engine %s: request %s names gateway %d, which has not joined; dropped",
                self.engine_id,
                req.request_id,
                req.gateway,
            )
            return
        err = self.engine.add_request(req)
        if err is not None:
            errors.append(err)

    def send_outputs(self, outputs: list[EngineOutput], batch: EngineOutputs | None = None) -> None:
        """Each output to the gateway that owns its request: one message per
        gateway (the whole batch when one gateway owns them all)."""
        outs = self.outs
        owners = outs.owners
        finished = False
        by_gateway: dict[int | None, list[EngineOutput]] = {}
        for out in outputs:
            by_gateway.setdefault(owners.get(out.request_id), []).append(out)
            if out.finish_reason is not None:
                finished = True
        for session, group in by_gateway.items():
            if session is None:
                continue  # its gateway is gone
            if batch is not None and len(by_gateway) == 1:
                msg = batch
            else:
                msg = EngineOutputs(
                    self.engine_id, group, time.time(), batch.scheduler_stats if batch else None
                )
            outs.send(session, [b"O", self._enc.encode(msg)])
        if finished:
            outs.prune(self.live_client_ids())

    def live_client_ids(self) -> set[str]:
        return {r.parent_id or r.request_id for r in self.engine.unfinished_requests()}

    def heartbeat(self, epoch: int) -> None:
        """Its arrival is each gateway's proof that the loop runs."""
        beat = EngineHeartbeat(self.engine_id, epoch, self.engine.num_steps)
        self.outs.send_all_nowait([b"H", self._enc.encode(beat)])

    def check_integrity(self) -> None:
        """Every request the engine holds has a registered gateway."""
        if self.outs is not None:
            self.outs.check_integrity(self.live_client_ids())

    # ---- membership --------------------------------------------------------------

    def sessions(self) -> list[int]:
        return self.outs.sessions() if self.outs is not None else []

    @property
    def snapshot(self) -> tuple[int, ...]:
        """``sessions()`` from any thread (a snapshot the loop replaces)."""
        return self.outs.session_snapshot if self.outs is not None else ()

    def join(self, output_addr: str, session: int) -> bool:
        """Gateway ``session`` serves from this engine too; its requests'
        outputs go to ``output_addr``. The other gateways keep their
        requests. False if it had joined. A gone gateway whose address the
        new one reuses (a port freed and taken again) is dropped first: its
        connection would look alive."""
        for link in list(self.outs.links.values()):
            if link.addr == output_addr and link.session != session:
                self.drop(link.session, "a new gateway took its address")
        return self.outs.add(session, output_addr)

    def switch(self, output_addr: str, session: int = 0) -> int:
        """The gateway at ``output_addr`` becomes the only one. Every other
        gateway is dropped with its requests (their KV freed, their held
        outputs discarded). Returns the number of requests aborted."""
        num = sum(self.drop(s, "replaced") for s in self.sessions())
        self.outs.add(session, output_addr, default=True)
        return num

    def drop(self, session: int, why: str) -> int:
        """Forget gateway ``session``; abort the requests it owns (nothing
        would read their outputs). Returns how many."""
        outs = self.outs
        if outs is None or session not in outs.links:
            return 0
        owned = set(outs.requests_of(session))
        ids = [
            r.request_id
            for r in self.engine.unfinished_requests()
            if (r.parent_id or r.request_id) in owned
        ]
        if ids:
            self.engine.abort(ids)
        outs.close(session)
        self.num_gateways_lost += why != "it left" and why != "replaced"
        self.num_gateway_requests_aborted += len(owned)
        logger.log(
            logging.INFO if why == "it left" else logging.WARNING,
            "engine %s: gateway %d dropped (%s): %d requests aborted",
            self.engine_id,
            session,
            why,
            len(owned),
        )
        return len(ids)

    def cut_streams(self, link: Any) -> None:
        """Gateway ``link`` read nothing for ``output_stall_timeout_s``: end
        every unfinished request it owns with an error (freeing its KV) and
        queue one error output for them, so that gateway learns why if it
        comes back. The other gateways' requests go on."""
        sender = link.sender
        stall_s = sender.stalled_s
        owned = set(self.outs.requests_of(link.session))
        unfinished = [
            r for r in self.engine.unfinished_requests() if (r.parent_id or r.request_id) in owned
        ]
        ids = [r.request_id for r in unfinished]
        client_ids = list(dict.fromkeys(r.parent_id or r.request_id for r in unfinished))
        self.num_streams_cut += len(client_ids)
        sender.reset_stall()
        if not ids:
            return
        logger.warning(
            "engine %s: gateway %d read no output for %.0f s: cutting %d streams",
            self.engine_id,
            link.session,
            stall_s,
            len(ids),
        )
        self.engine.abort(ids)
        self.outs.forget(client_ids)
        message = f"engine {self.engine_id}: outputs not read for {stall_s:.0f} s"
        errors = [
            EngineOutput(request_id=rid, finish_reason=FinishReason.ERROR, error=message)
            for rid in client_ids  # a fork's children: one error for the client's request
        ]
        sender.send([b"O", self._enc.encode(EngineOutputs(self.engine_id, errors, time.time()))])
