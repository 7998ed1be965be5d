"""Decode migration: a stream whose decode engine dies or is drained goes on
elsewhere, token-identical.

Why identical: a seeded row samples with ``u = f(seed, position)``
(``workers.sampling.sampler``) and greedy needs no randomness, so the next token depends
only on the token sequence so far and the sampling parameters. The gateway
resubmits the *same* request with every token already sent to the client
appended to the prompt and ``max_tokens`` / ``min_tokens`` reduced by their
count; the new engine samples position ``len(prompt) + n`` next, exactly the
position the dead one would have sampled. Nothing is repeated (the sent tokens
are prompt now) and nothing is missed (the first new output is the next one).

    client <-- t0 t1 t2 | engine decode-0 dies (DEAD in cluster/engines/health.py,
                        | or drained by an operator)
    gateway: ledger = [t0 t1 t2]; request' = prompt+[t0 t1 t2], max_tokens-3
             the new decode engine D first: the router's cost over the
             survivors (kv-aware: prefix hit and load, so one that holds
             prompt' cached is preferred; RoutingPolicy.plan_migration),
             then KV for D by the tokens of prompt' that D does not hold:
               < handoff_min_tokens : D prefills them itself
                                      (its prefix cache hits the rest)
               >= and a prefill engine ready : P recomputes prompt' and samples
                                      t3, D reads what it lacks (the normal handoff)
    client <-- t3 t4 ...            (same SSE stream, same request id)

A SLOW engine is never migrated (its requests complete when it catches up);
only the backend's DEAD / restarted / drained verdicts are. A request
migrates at most ``max_migrations`` times; past that, or with no engine to go
to within ``wait_for_engine_s``, it ends with an explicit error output.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec

from tandem.cluster.disagg.engine import Engine
from tandem.cluster.routing.router import Router
from tandem.wire.engine_protocol import EngineOutput, EngineRequest

if TYPE_CHECKING:
    from tandem.cluster.disagg.data_plane import OutputStream

logger = logging.getLogger(__name__)

# tandem:migrations_total{reason}
REASON_DEAD = "engine_dead"  # health says DEAD (Ray says so, or no heartbeat)
REASON_RESTARTED = "engine_restarted"  # a new epoch answered: the old one's work is gone
REASON_DRAIN = "drain"  # an operator drained the engine


@dataclass(frozen=True)
class MigrationPolicy:
    """``enabled``: migrate at all (``--no-migration`` turns it off).
    ``max_migrations``: per request (``--max-migrations``, default 3).
    ``handoff_min_tokens``: when the new decode engine lacks at least this many
    tokens of the context (its prefix cache holds the rest), its KV comes by a
    fresh prefill handoff if a prefill engine is ready; fewer are recomputed by
    the decode engine (measured by ``benchmarks/migration.py``).
    ``wait_for_engine_s``: how long a stream waits for a ready engine to move to
    (e.g. the restarted one when it was the only decode engine)."""

    enabled: bool = True
    max_migrations: int = 3
    handoff_min_tokens: int = 256
    wait_for_engine_s: float = 30.0

    def __post_init__(self) -> None:
        if self.max_migrations < 0:
            raise ValueError(f"max_migrations must be >= 0, got {self.max_migrations}")
        if self.handoff_min_tokens < 0:
            raise ValueError(
                f"migration_handoff_min_tokens must be >= 0, got {self.handoff_min_tokens}"
            )
        if self.wait_for_engine_s < 0:
            raise ValueError(f"migration_wait_s must be >= 0, got {self.wait_for_engine_s}")


class EngineLost(Exception):
    """Raised out of a decode stream when its engine was declared dead,
    restarted or drained, so the stream may migrate. ``reason`` is one of the
    ``REASON_*`` labels, ``engine_id``/``epoch`` the incarnation lost."""

    def __init__(self, reason: str, engine_id: str, epoch: int, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.engine_id = engine_id
        self.epoch = epoch
        self.message = message


class StreamLedger:
    """What one request has already delivered: the tokens the client got.

    ``record`` every output the backend yields; ``resubmission`` builds the
    request that continues the stream on another engine."""

    def __init__(self, request: EngineRequest) -> None:
        self.request = request
        self.sent_token_ids: list[int] = []
        self.num_migrations = 0
        self.lost: set[tuple[str, int]] = set()  # (engine_id, epoch) this request lost

    def record(self, output: EngineOutput) -> None:
        self.sent_token_ids.extend(output.new_token_ids)

    def can_migrate(self, policy: MigrationPolicy) -> bool:
        return policy.enabled and self.num_migrations < policy.max_migrations

    def resubmission(self) -> EngineRequest:
        """The original request, continued after the tokens already sent: they
        join the prompt and count against ``max_tokens`` / ``min_tokens``, yet
        stay output tokens for the penalties (``num_penalty_prompt_tokens`` =
        the client's prompt length); prompt logprobs, delivered with the first
        tokens, are not asked again; no
        KV transfer parameters (the caller picks how the new engine gets the KV)."""
        req = self.request
        sp = req.sampling_params
        n = len(self.sent_token_ids)
        if n >= sp.max_tokens:
            raise ValueError(f"request {req.request_id}: {n} tokens sent, nothing left to generate")
        num_penalty_prompt = sp.num_penalty_prompt_tokens
        if num_penalty_prompt < 0:
            num_penalty_prompt = len(req.prompt_token_ids)
        return msgspec.structs.replace(
            req,
            prompt_token_ids=list(req.prompt_token_ids) + self.sent_token_ids,
            sampling_params=msgspec.structs.replace(
                sp,
                max_tokens=sp.max_tokens - n,
                min_tokens=max(0, sp.min_tokens - n),
                num_penalty_prompt_tokens=num_penalty_prompt,
                # they came with the first tokens: already delivered once n > 0
                prompt_logprobs=sp.prompt_logprobs if n == 0 else None,
            ),
            kv_transfer_params=None,
        )


class Migrator:
    """Whether a stream that lost its engine moves on, and where it may not
    go. ``role``: the pool a stream continues in (decode, or colocated).
    ``num_migrations``: reason -> count (``tandem:migrations_total``)."""

    def __init__(
        self, policy: MigrationPolicy, engines: dict[str, Engine], router: Router, role: str
    ) -> None:
        self.policy = policy
        self.engines = engines
        self.router = router
        self.role = role
        self.num_migrations: dict[str, int] = {}

    def lost_engines(self, ledger: StreamLedger) -> set[str]:
        """Engines whose current incarnation this request lost: never again
        (a late output of the old run could not be told from the new one's)."""
        return {eid for eid, epoch in ledger.lost if self.engines[eid].state.epoch == epoch}

    async def prepare(self, lost: EngineLost, q: OutputStream, ledger: StreamLedger) -> str | None:
        """Decide whether the stream moves on; wait (bounded) for an engine to
        take it. Returns None to resubmit, else the error text to end with."""
        ledger.lost.add((lost.engine_id, lost.epoch))
        if not self.policy.enabled:
            return lost.message
        if ledger.request.n > 1:  # the ledger follows one choice's tokens, not n
            return f"{lost.message} (requests with n > 1 do not migrate)"
        if not ledger.can_migrate(self.policy):
            return f"{lost.message} (migrated {ledger.num_migrations} times already)"
        while not q.empty():  # anything still queued came from the lost engine
            q.get_nowait()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.policy.wait_for_engine_s
        while True:
            exclude = self.lost_engines(ledger)
            if any(st.engine_id not in exclude for st in self.router.ready_engines(self.role)):
                break
            if loop.time() >= deadline:
                return (
                    f"{lost.message}; no {self.role} engine to continue on within "
                    f"{self.policy.wait_for_engine_s:g} s"
                )
            await asyncio.sleep(0.05)
        ledger.num_migrations += 1
        self.num_migrations[lost.reason] = self.num_migrations.get(lost.reason, 0) + 1
        logger.info(
            "request %s: %s on %s; migrating after %d tokens",
            ledger.request.request_id,
            lost.reason,
            lost.engine_id,
            len(ledger.sent_token_ids),
        )
        return None
