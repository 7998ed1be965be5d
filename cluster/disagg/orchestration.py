"""One request's path across engines: plan -> prefill -> handoff -> decode.

Disaggregated request (docs/architecture.md, section 2; the two requests
are built by ``kvtransfer/handoff.py``):

    P <- prompt, max_tokens=1, {do_remote_decode}
    P -> first token + kv_transfer_params      -> streamed to the client at once
    D <- prompt + first token, max_tokens-1, P's params + {do_remote_prefill}
    D -> tokens ...                            -> streamed

The router plans each try (``cluster/routing``): which decode engine, and
whether a prefill engine computes the prompt first (short prompts and
prefix hits prefill on D). The engine that computes the prompt (the prefill
engine, or D when P does not run, or a colocated engine) is lent the part of it
another engine's host KV tier holds beyond its own, first (``tier_lending.py``).
A prefill that fails is retried once on another prefill engine, else D
prefills itself. Without prefill/decode pools, one
colocated engine runs the whole request.

A decode or colocated engine declared DEAD, restarted or drained raises
``EngineLost`` out of its stream; ``generate`` asks the ``Migrator``
(``migration.py``) and, unless it refuses, resubmits the ledger's
continuation (prompt + every token already sent) as a new try, so the
client's stream goes on token-identical.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import zmq

from tandem.cluster.disagg.data_plane import DataPlane, EngineFailed, OutputStream
from tandem.cluster.disagg.engine import Engine, Traffic
from tandem.cluster.disagg.migration import EngineLost, Migrator, StreamLedger
from tandem.cluster.disagg.tier_lending import TierLending
from tandem.cluster.gateway.backend import BackendUnavailable
from tandem.cluster.routing.cluster_routing import ClusterRouting, PromptHashes
from tandem.cluster.routing.policy import Choice
from tandem.kvtransfer.handoff import decode_request, prefill_request
from tandem.wire.engine_protocol import EngineOutput, EngineRequest, FinishReason

logger = logging.getLogger(__name__)


class Orchestrator:
    def __init__(
        self,
        engines: dict[str, Engine],
        plane: DataPlane,
        routing: ClusterRouting,
        migrator: Migrator,
        disaggregated: bool,
        traffic: Traffic | None = None,
    ) -> None:
        self.engines = engines
        self.traffic = traffic or Traffic()
        self.plane = plane
        self.routing = routing
        self.migrator = migrator
        self.disaggregated = disaggregated
        self.lending = TierLending(engines, routing)

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        """``Backend.generate``: tries until the stream ends by itself or
        migration gives up (an error output)."""
        rid = request.request_id
        sp = request.sampling_params
        self.traffic.arrived(len(request.prompt_token_ids), sp.max_tokens * max(1, request.n))
        q = self.plane.open_stream(rid)
        ledger = StreamLedger(request)
        finished = False
        hashes = self.routing.hashes(request)
        try:
            attempt = request
            while True:
                try:
                    async for out in self._attempt(attempt, q, ledger, hashes):
                        ledger.record(out)
                        yield out
                    finished = True  # the stream ended by itself: every choice finished
                    return
                except EngineLost as lost:
                    error = await self.migrator.prepare(lost, q, ledger)
                    if error is not None:
                        finished = True
                        yield error_output(rid, error)
                        return
                    attempt = ledger.resubmission()
                    hashes = self.routing.hashes(attempt)
        finally:
            if ledger.sent_token_ids:  # a refused or failed request says nothing of lengths
                self.traffic.ended(len(ledger.sent_token_ids))
            if not finished:
                self.plane.abort(rid)
            self.plane.close_stream(rid)

    async def _attempt(
        self, request: EngineRequest, q: OutputStream, ledger: StreamLedger, hashes: PromptHashes
    ) -> AsyncIterator[EngineOutput]:
        """One try at ``request``: (P then) D, or a colocated engine. Raises
        ``EngineLost`` out of the generating engine's stream (migration)."""
        migrated = ledger.num_migrations > 0
        exclude = self.migrator.lost_engines(ledger)
        if not self.disaggregated:
            choice = self._pick("colocated", hashes, streaming=migrated, exclude=exclude)
            if choice is None:
                yield error_output(request.request_id, "no ready colocated engine")
                return
            request = await self.lending.lend(choice, request, hashes)
            async for out in self._stream(choice, request, q, True, request.n):
                yield out
            return
        first = None
        # n > 1: P prefills all but the last prompt token and samples nothing;
        # D forks the children and each samples its own first token
        # (scheduler/fork.py), so a one-token prompt has nothing for P
        n = request.n
        num_prompt = len(request.prompt_token_ids)
        split = request.sampling_params.max_tokens > 1 if n == 1 else num_prompt > 1
        decode_choice = None
        if migrated:  # D by prefix and load, P only for what D lacks (migration.py)
            handoff_min = self.migrator.policy.handoff_min_tokens
            plan = self.routing.plan_migration(hashes, split, handoff_min, exclude)
            if plan is None:
                yield error_output(request.request_id, "no ready decode engine")
                return
            remote, decode_choice = plan.remote_prefill, plan.decode
        else:
            plan = self.routing.plan(hashes, split)
            if plan is None:
                raise BackendUnavailable("no ready decode engine")
            remote, decode_choice = plan.remote_prefill, plan.decode
        if remote:
            first = await self._remote_prefill(request, q, hashes)
        if first is not None:
            if first.finished:  # EOS as the first token: nothing to hand off
                yield first
                return
            if first.new_token_ids:
                yield first
            request = decode_request(request, first)
        choice = decode_choice
        if choice is None or not choice.engine.ready:  # it went away while P ran
            choice = self._pick(
                "decode", hashes, streaming=first is not None or migrated, exclude=exclude
            )
        if choice is None:
            yield error_output(request.request_id, "no ready decode engine")
            return
        if first is None:  # D computes the prompt: a peer's host tier may lend
            request = await self.lending.lend(choice, request, hashes)
        async for out in self._stream(choice, request, q, first is None, n):
            yield out

    def _pick(
        self,
        role: str,
        hashes: PromptHashes,
        streaming: bool = False,
        exclude: set[str] = frozenset(),
    ) -> Choice | None:
        choice = self.routing.choose(role, hashes, exclude=exclude)
        if choice is None:
            if streaming:
                return None
            raise BackendUnavailable(f"no ready {role} engine")
        return choice

    async def _remote_prefill(
        self, request: EngineRequest, q: OutputStream, hashes: PromptHashes
    ) -> EngineOutput | None:
        """Run the prompt on a prefill engine; retry once on another. Returns
        P's output (first token + kv_transfer_params), or None to prefill on
        the decode engine instead."""
        p_req = prefill_request(request)
        tried: set[str] = set()
        for _ in range(2):
            choice = self.routing.choose("prefill", hashes, exclude=tried)
            if choice is None:
                return None
            st = choice.engine
            tried.add(st.engine_id)
            # a peer's host tier may hold more of the prompt than P does: P READs it first
            lent_req = await self.lending.lend(choice, p_req, hashes)
            out = None
            async for o in self._stream(choice, lent_req, q, observe=True):
                out = o
            if out is None or out.finish_reason == FinishReason.ERROR:
                logger.warning("prefill on %s failed: %s", st.engine_id, out and out.error)
                continue
            if request.n > 1 and not out.kv_transfer_params:
                return None  # nothing handed off: D prefills and forks by itself
            if out.finish_reason == FinishReason.LENGTH and out.kv_transfer_params:
                return EngineOutput(
                    request_id=out.request_id,
                    new_token_ids=out.new_token_ids,
                    new_logprobs=out.new_logprobs,
                    prompt_logprobs=out.prompt_logprobs,
                    num_cached_tokens=out.num_cached_tokens,
                    kv_transfer_params=out.kv_transfer_params,
                    timings=out.timings,
                )
            return out  # finished on P (EOS / stop token): final as is
        return None

    async def _stream(
        self,
        choice: Choice,
        request: EngineRequest,
        q: OutputStream,
        observe: bool = False,
        num_choices: int = 1,
    ) -> AsyncIterator[EngineOutput]:
        """``request`` on one engine until ``num_choices`` choices finished
        (each finishes once) or an error ended it. ``observe``: this engine
        computes the prompt; its reported prefix hit is compared with the
        router's prediction, and until then the prompt's predicted uncached
        tokens count in the engine's ``queued_prefill_tokens``."""
        e = self.engines[choice.engine.engine_id]
        eid = e.state.engine_id
        e.requests.add(request.request_id)
        e.state.num_inflight += 1
        queued = len(request.prompt_token_ids) - choice.predicted_hit_tokens if observe else 0
        e.state.queued_prefill_tokens += queued
        self.routing.load_changed()  # several gateways: the others hear of it (peer_load.py)
        try:
            try:
                self.plane.send(e, b"R", request)
            except zmq.Again:  # the engine stopped reading: its output queue is full
                yield error_output(request.request_id, f"engine {eid} is not accepting requests")
                return
            while True:
                source, item = await q.get()
                if source != eid:
                    continue  # late output of an engine this request left
                if isinstance(item, EngineFailed):
                    if item.lost is not None and e.state.role != "prefill":
                        raise EngineLost(item.lost, eid, item.epoch, item.message)
                    yield error_output(request.request_id, item.message)
                    return
                out: EngineOutput = item
                if observe and out.finish_reason != FinishReason.ERROR:
                    observe = False
                    e.state.queued_prefill_tokens -= queued
                    queued = 0
                    self.routing.load_changed()
                    self.routing.observe_hit(request.request_id, choice, out.num_cached_tokens)
                yield out
                if out.finished:
                    num_choices -= 1
                    if num_choices <= 0 or out.finish_reason is FinishReason.ERROR:
                        return
        finally:
            e.state.num_inflight -= 1
            e.state.queued_prefill_tokens -= queued
            self.routing.load_changed()


def error_output(request_id: str, message: str) -> EngineOutput:
    return EngineOutput(request_id=request_id, finish_reason=FinishReason.ERROR, error=message)
