"""A prompt's prefix lent from another engine's host KV tier to the engine that computes it.

    reader B: the engine that computes the prompt: a colocated engine, a decode
              engine P does not run for (short prompt, small miss, tiers hold it),
              or the prefill engine chosen for it (before it prefills)
    here:     the request wants no prompt logprobs (a cache hit never serves those);
              the engine A (not B) whose host tier holds the longest leading run of
              the prompt's blocks, longer than B's own (device + own tiers), and that
              B knows as a peer (A's incarnation is in the endpoint list B
              acknowledged); lenders of a prefill or decode reader are the prefill
              and decode engines, of a colocated one the colocated engines
            A.kv_tier_export(run's hashes) over Ray, deadline ``timeout_s``
              params -> B's request carries them (a prefill request keeps its
                        do_remote_decode): B READs the run from A's host tier
                        (WAITING_FOR_REMOTE_KVS; a failed READ is recomputed), computes
                        the rest, the lent tokens counted as cached
              None, error, late -> B's request goes plain: B recomputes
    A's pins end with B's "done" (B read it, or B dropped the request: an abort, a
    failure) or with the export's lease (B never saw it: the send failed, the gateway's
    deadline passed first), so nothing stays pinned (kvtransfer/tiers/export.py).

Every outcome is counted in the router's decisions as ``tier_lend/<outcome>``
(``tandem:router_decisions_total{role="tier_lend",reason}``).
"""

from __future__ import annotations

import asyncio
import logging

import msgspec

from tandem.cluster.disagg.engine import Engine
from tandem.cluster.routing.cluster_routing import ClusterRouting, PromptHashes
from tandem.cluster.routing.policy import Choice
from tandem.wire.engine_protocol import EngineRequest

logger = logging.getLogger(__name__)

# reader's pool -> lenders' pools
LENDER_ROLES = {
    "prefill": ("prefill", "decode"),
    "decode": ("prefill", "decode"),
    "colocated": ("colocated",),
}


class TierLending:
    def __init__(
        self, engines: dict[str, Engine], routing: ClusterRouting, timeout_s: float = 2.0
    ) -> None:
        self.engines = engines
        self.routing = routing
        self.timeout_s = timeout_s

    async def lend(
        self, choice: Choice, request: EngineRequest, hashes: PromptHashes
    ) -> EngineRequest:
        """``request`` as it goes to ``choice``'s engine: with a peer's tier
        prefix in its ``kv_transfer_params`` when one was lent, else unchanged.
        A lent prefix raises ``choice.predicted_hit_tokens`` to the lent tokens."""
        own = request.kv_transfer_params or {}
        if own.get("do_remote_prefill"):
            return request  # it loads a prefill engine's KV already
        if request.sampling_params.prompt_logprobs is not None:
            return request  # every prompt token's logits are wanted: nothing may be skipped
        reader = self.engines[choice.engine.engine_id]
        lender_roles = LENDER_ROLES.get(reader.state.role)
        if lender_roles is None:
            return request
        known = reader.pushed_endpoints
        if known is None or known[0] != reader.state.epoch:
            return request
        peers = {(ep[0], ep[1]) for ep in known[1]}
        ids = [
            eid
            for eid, e in self.engines.items()
            if eid != reader.state.engine_id
            and e.state.role in lender_roles
            and e.answered  # a drained engine still lends
            and (eid, e.state.epoch) in peers
        ]
        found = self.routing.tier_lender(hashes, reader.state.role, lender_roles, reader, ids)
        if found is None:
            return request
        lender_id, run = found
        lender = self.engines[lender_id]
        try:
            ref = lender.handle.actor.kv_tier_export.remote(run)
            params = await asyncio.wait_for(_await_ref(ref), self.timeout_s)
        except Exception as exc:  # noqa: BLE001 - recompute instead; the lease frees A
            logger.warning("kv_tier_export on %s failed: %s", lender_id, exc)
            self.routing.count("tier_lend", "failed")
            return request
        if not params:
            self.routing.count("tier_lend", "none")
            return request
        self.routing.count("tier_lend", "lent")
        lent = int(params.get("num_tokens", 0))
        self.routing.notes.lent(request.request_id, lender_id, lent)
        choice.predicted_hit_tokens = max(choice.predicted_hit_tokens, lent)
        return msgspec.structs.replace(request, kv_transfer_params={**own, **params})


async def _await_ref(ref):
    return await ref
