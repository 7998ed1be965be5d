"""Router policies: which engine of a pool gets a request, and whether a
disaggregated request needs the prefill pool at all.

    round-robin  each pool in turn
    least-load   cluster/routing/router.py's load rule (no prefix knowledge)
    kv-aware     lowest cost with the cluster prefix index (index.py):

      decode / colocated engine e, prompt of n tokens, hit_e tokens held:
        cost(e) = hit_weight * (n - hit_e) / n
                + prefill_queue_weight * queued_prefill_tokens_e / n
                + load_weight * (kv_usage_e + max(inflight_e, running_e + waiting_e) / max_num_seqs_e)
      prefill engine e (both terms in tokens):
        cost(e) = (n - hit_e) + prefill_queue_weight * queued_prefill_tokens_e

    ``queued_prefill_tokens_e``: uncached prompt tokens (as predicted) of the
    requests sent to e that have not yet had their first output there: work
    e must do before it starts this prompt. The first two decode terms are
    that work in units of this prompt, so a holder that already has a
    backlog of prefills larger than the tokens it would save gives way.
    With several gateways, ``inflight_e`` and ``queued_prefill_tokens_e`` are
    every gateway's: this one's plus the others' as published (peer_load.py).

    Busy engines (decode / colocated): an engine whose load (the last term's
    parenthesis) is above ``busy_threshold`` is passed over while some other
    candidate is at or below it, whatever it holds. The cost alone lets a
    full holder win over an idle engine until it is fuller by a whole
    engine's worth (see below): a popular prefix piled every request on one
    engine while the others idled. Below the threshold affinity rules; above
    it a busy holder yields, and the engine that takes the prefix caches it
    too. When every candidate is busy, the cost decides among all.

    Ties (e.g. a prompt cached nowhere, equal loads) go by rendezvous hash of
    the prompt's first block and the engine id, so distinct prefixes spread
    over the pool instead of piling on one engine; then by engine id. With the defaults (1, 1, 1) a full
    prefix hit beats a cold engine unless the holder is fuller by more than
    a whole engine's worth of running share + KV usage (an overloaded one).

Disaggregated plan (kv-aware): the decode engine D is chosen first. Then
    D holds every block it can take from cache  -> prefill on D ("decode_holds_prompt")
    D's tiers or a peer's host tier hold them   -> prefill on D ("tiers_hold_prompt"):
                                                   D loads or borrows them (KV tiers)
    n - below_D < disagg_min_tokens             -> prefill on D ("small_miss")
    else                                        -> prefill engine by cost ("remote_prefill")
(``below_D``, below: what D has without computing, its device hit included.)
The other policies keep the length rule: n < disagg_min_tokens -> on D.

Migration plan (a stream moved off a lost decode engine, cluster/disagg/migration.py;
n = prompt + tokens already sent): the decode engine is chosen first, by the
same cost (so a survivor holding the context is preferred), then
    n - hit_D >= handoff_min_tokens and a prefill engine ready
        -> fresh P handoff ("migration_handoff"; D reads only what it lacks)
    else -> D recomputes what its cache misses ("migration_recompute")
Without the index (round-robin, least-load) hit_D is 0: the length rule.

Below the device (KV tiers): ``below_e`` >= ``hit_e`` is the prefix e could have
without computing it: its device, its own host or disk tier, or another
engine's host tier (``PrefixIndex.match_below``). The kv-aware cost uses
``hit_e + TIER_HIT_WEIGHT * (own_e - hit_e) + PEER_TIER_HIT_WEIGHT * (below_e - own_e)``
in place of ``hit_e``, where ``own_e`` leaves other engines' tiers out: a block in
e's own tier (a local load) scores below a device hit, a block in another engine's
host tier (a NIXL READ) below that, and both above nothing. Only an engine that READs over
NIXL (``kv_role`` "both" or "decode": a prefill engine serving only, or an engine
without the connector, does not) counts other engines' tiers: for the rest
``below_e`` is ``own_e``. ``predicted_hit_tokens``
keeps the device hit (``Choice.below_tokens`` is ``below_e``); the disaggregated plan
weighs ``below_D``: a prompt the tiers hold, or all but fewer than
``disagg_min_tokens`` of it, is not worth a prefill engine.

``hit`` never counts the block holding the prompt's last token (an engine
always computes at least one token), exactly as the engine's scheduler does.
"""

from __future__ import annotations

import itertools
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

from tandem.cluster.routing.index import PrefixIndex
from tandem.cluster.routing.router import EngineState, Router, load
from tandem.wire.config_fields import option

ROUTER_POLICIES = ("round-robin", "least-load", "kv-aware")
TIER_HIT_WEIGHT = 0.5  # a token in the engine's own KV tier, against one on its device
PEER_TIER_HIT_WEIGHT = 0.25  # a token in another engine's host tier (a NIXL READ away)


@dataclass(frozen=True)
class RoutingConfig:
    """The router's settings (module doc): a section of the serve configuration,
    flags ``--router``, ``--router-*``, ``--disagg-min-tokens``."""

    router: str | None = option(
        None,
        choices=ROUTER_POLICIES,
        default_text="kv-aware when a pool has more than one engine, else least-load",
        help="engine choice in each pool",
    )
    hit_weight: float = option(
        1.0,
        key="router_hit_weight",
        help="kv-aware decode/colocated cost: weight of the uncached prompt share",
    )
    load_weight: float = option(
        1.0,
        key="router_load_weight",
        help="kv-aware decode/colocated cost: weight of KV usage + running share",
    )
    prefill_queue_weight: float = option(
        1.0,
        key="router_prefill_queue_weight",
        help="kv-aware cost: weight of an engine's queued prefill tokens vs the prompt's "
        "uncached ones",
    )
    # load: KV usage + running share, ~0 idle .. ~2 full
    busy_threshold: float = option(
        0.5,
        key="router_busy_threshold",
        default_text="0.5 (100 = never)",
        help="kv-aware: a decode/colocated engine whose load (KV usage + running share) is "
        "above this is passed over while another is not, prefix or not",
    )
    disagg_min_tokens: int = option(
        0, help="prompts with fewer tokens prefill on the decode engine"
    )

    def __post_init__(self) -> None:
        if self.router is not None and self.router not in ROUTER_POLICIES:
            raise ValueError(
                f"router must be one of {', '.join(ROUTER_POLICIES)}, got {self.router!r}"
            )
        for name in ("hit_weight", "load_weight", "prefill_queue_weight", "busy_threshold"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"router_{name} must be >= 0, got {getattr(self, name)}")
        if self.disagg_min_tokens < 0:
            raise ValueError(f"disagg_min_tokens must be >= 0, got {self.disagg_min_tokens}")

    def resolve(self, pool_sizes: dict[str, int]) -> str:
        if self.router is not None:
            return self.router
        return "kv-aware" if any(n > 1 for n in pool_sizes.values()) else "least-load"


@dataclass
class Choice:
    engine: EngineState
    reason: str
    predicted_hit_tokens: int = 0  # on its device (what it will report cached)
    below_tokens: int = 0  # without computing: device, own tiers, peers' host tiers


@dataclass
class Plan:
    """A disaggregated request's route: its decode engine, and whether P runs."""

    decode: Choice
    remote_prefill: bool
    reason: str


def reads_peers(e: EngineState) -> bool:
    """Can ``e`` READ a prefix from another engine over NIXL (its ``kv_role`` from
    ``ready()``)? A prefill engine that only serves cannot, nor an engine without a
    connector; an engine that has not said (a test's state) is taken to read."""
    return e.info.get("kv_role", "both") in ("both", "decode")


def max_hit_blocks(num_prompt_tokens: int, block_size: int) -> int:
    """Blocks an engine may take from cache: the last token is always computed."""
    return max(num_prompt_tokens - 1, 0) // block_size


class RoutingPolicy:
    """Chooses engines with ``router``'s live state and (kv-aware) ``index``.
    Counts each decision in ``decisions[(role, reason)]``."""

    def __init__(
        self, config: RoutingConfig, router: Router, index: PrefixIndex | None, name: str
    ) -> None:
        if name not in ROUTER_POLICIES:
            raise ValueError(f"router must be one of {', '.join(ROUTER_POLICIES)}, got {name!r}")
        self.config = config
        self.router = router
        self.index = index if name == "kv-aware" else None
        self.name = name
        self._rr = {role: itertools.count() for role in ("prefill", "decode", "colocated")}
        self.decisions: dict[tuple[str, str], int] = {}

    def _count(self, role: str, reason: str) -> None:
        self.decisions[(role, reason)] = self.decisions.get((role, reason), 0) + 1

    def choose(
        self,
        role: str,
        num_prompt_tokens: int,
        hashes: Sequence[bytes] = (),
        exclude: set[str] = frozenset(),
        *,
        block_size: int = 0,
    ) -> Choice | None:
        """One engine of ``role``; ``hashes`` are the prompt's full-block
        hashes with the pool's block size and hash algorithm."""
        cands = [e for e in self.router.ready_engines(role) if e.engine_id not in exclude]
        if not cands:
            return None
        if self.name == "round-robin":
            e = cands[next(self._rr[role]) % len(cands)]
            self._count(role, "round_robin")
            return Choice(e, "round_robin", self._hit_of(e, hashes, num_prompt_tokens, block_size))
        if self.name == "least-load" or self.index is None:
            if role == "prefill":
                e = self.router.pick_prefill(exclude)
            else:
                e = self.router.pick_generator(role, exclude)
            assert e is not None
            self._count(role, "least_load")
            return Choice(e, "least_load", self._hit_of(e, hashes, num_prompt_tokens, block_size))
        c = self.config
        if role != "prefill":  # busy engines yield while one is not (module doc)
            cands = [e for e in cands if load(e) <= c.busy_threshold] or cands
        hit = self._hits(cands, hashes, num_prompt_tokens, block_size)
        own = self._hits(cands, hashes, num_prompt_tokens, block_size, below="own")
        below = self._hits(cands, hashes, num_prompt_tokens, block_size, below="peers")
        for e in cands:  # another engine's host tier counts only for an engine that READs
            if not reads_peers(e):
                below[e.engine_id] = own[e.engine_id]
        held = {  # tier tokens count a part of a device token (module doc)
            eid: h
            + TIER_HIT_WEIGHT * (own[eid] - h)
            + PEER_TIER_HIT_WEIGHT * (below[eid] - own[eid])
            for eid, h in hit.items()
        }
        n = max(num_prompt_tokens, 1)
        first = hashes[0] if hashes else b""

        def tie(e: EngineState) -> int:
            return zlib.crc32(first + e.engine_id.encode())

        if role == "prefill":

            def cost(e: EngineState) -> tuple[float, int, str]:
                miss = n - held[e.engine_id]
                value = miss + c.prefill_queue_weight * e.all_queued_prefill_tokens
                return (value, tie(e), e.engine_id)
        else:

            def cost(e: EngineState) -> tuple[float, int, str]:
                miss = (n - held[e.engine_id]) / n
                queued = e.all_queued_prefill_tokens / n
                value = c.hit_weight * miss + c.prefill_queue_weight * queued
                return (value + c.load_weight * load(e), tie(e), e.engine_id)

        best = min(cands, key=cost)
        reason = "prefix_hit" if hit[best.engine_id] > 0 else "load"
        if reason == "load" and below[best.engine_id] > 0:
            reason = "tier_hit"
        self._count(role, reason)
        return Choice(best, reason, hit[best.engine_id], below[best.engine_id])

    def _hits(
        self,
        cands: Sequence[EngineState],
        hashes: Sequence[bytes],
        num_prompt_tokens: int,
        block_size: int,
        below: str = "",
    ) -> dict[str, int]:
        """Tokens held on each device; ``below`` "own": or in its own tiers, "peers":
        or in another engine's host tier too."""
        if self.index is None or not hashes or block_size < 1:
            return {e.engine_id: 0 for e in cands}
        cap = max_hit_blocks(num_prompt_tokens, block_size)
        ids = [e.engine_id for e in cands]
        if below:
            blocks = self.index.match_below(hashes[:cap], ids, peers=below == "peers")
        else:
            blocks = self.index.match(hashes[:cap], ids)
        return {eid: nb * block_size for eid, nb in blocks.items()}

    def _hit_of(
        self, e: EngineState, hashes: Sequence[bytes], num_prompt_tokens: int, block_size: int
    ) -> int:
        return self._hits([e], hashes, num_prompt_tokens, block_size)[e.engine_id]

    def plan_disaggregated(
        self,
        num_prompt_tokens: int,
        decode_hashes: Sequence[bytes],
        block_size: int,
        wants_remote: bool,
    ) -> Plan | None:
        """Decode engine first, then whether the prefill pool runs (module doc).
        ``wants_remote``: the request may use P at all (max_tokens > 1)."""
        d = self.choose("decode", num_prompt_tokens, decode_hashes, block_size=block_size)
        if d is None:
            return None
        has_p = bool(self.router.ready_engines("prefill"))
        n = num_prompt_tokens
        if not wants_remote or not has_p:
            reason = "no_prefill"
        elif self.index is not None:
            full = max_hit_blocks(n, block_size) * block_size if block_size else 0
            held = max(d.predicted_hit_tokens, d.below_tokens)  # KV tiers count
            if full and d.predicted_hit_tokens >= full:
                reason = "decode_holds_prompt"
            elif full and held >= full:
                reason = "tiers_hold_prompt"
            elif n - held < self.router.disagg_min_tokens:
                reason = "small_miss"
            else:
                reason = "remote_prefill"
        else:
            reason = "remote_prefill" if n >= self.router.disagg_min_tokens else "short_prompt"
        remote = reason == "remote_prefill"
        self.router.num_decisions["remote" if remote else "local"] += 1
        self._count("route", reason)
        return Plan(d, remote, reason)

    def plan_migration(
        self,
        num_prompt_tokens: int,
        decode_hashes: Sequence[bytes],
        block_size: int,
        wants_remote: bool,
        handoff_min_tokens: int,
        exclude: set[str] = frozenset(),
    ) -> Plan | None:
        """A migrated stream's route (module doc): its decode engine (not in
        ``exclude``, the engines it lost), then a P handoff only when that
        engine lacks at least ``handoff_min_tokens`` of the context."""
        d = self.choose("decode", num_prompt_tokens, decode_hashes, exclude, block_size=block_size)
        if d is None:
            return None
        has_p = bool(self.router.ready_engines("prefill"))
        num_missing = num_prompt_tokens - d.predicted_hit_tokens
        remote = wants_remote and has_p and num_missing >= handoff_min_tokens
        reason = "migration_handoff" if remote else "migration_recompute"
        self._count("route", reason)
        return Plan(d, remote, reason)
