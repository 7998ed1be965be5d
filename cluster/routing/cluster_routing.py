"""What the gateway's backend asks of routing, in one object.

    request --hashes (once per pool hashing)--> policy.choose / plan_disaggregated
            --engine's first output--> observe_hit(predicted, reported)
    every decision and hit is noted per request (route_log.py); the gateway
    takes the note into the request's finished line (``log_fields``).

The prompt's block hashes are computed here, once per request and per
distinct (block size, hash algorithm) of the pools, with
``scheduler.block_hash.hash_request_blocks`` and the request's
``cache_salt`` (the engines' own function), and only when the policy is
kv-aware. Engines tell their block size and algorithm in ``ready``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from tandem.cluster.routing.hit_error import HitErrorHistogram
from tandem.cluster.routing.index import PrefixIndex
from tandem.cluster.routing.peer_load import PeerLoadChannel
from tandem.cluster.routing.policy import (
    Choice,
    Plan,
    RoutingConfig,
    RoutingPolicy,
    max_hit_blocks,
)
from tandem.cluster.routing.route_log import RouteNotes
from tandem.cluster.routing.router import Router
from tandem.cluster.routing.subscriber import KVEventSubscriber
from tandem.scheduler.block_hash import hash_request_blocks
from tandem.scheduler.kv_events import KVSnapshot
from tandem.wire.engine_protocol import EngineRequest
from tandem.wire.frames import FrameCounters

logger = logging.getLogger(__name__)


class PromptHashes:
    """One request's prompt hashes per pool role, computed on first use."""

    def __init__(self, request: EngineRequest, hashing: dict[str, tuple[int, str]]) -> None:
        self.request = request
        self._hashing = hashing
        self._by_hashing: dict[tuple[int, str], list[bytes]] = {}

    def block_size(self, role: str) -> int:
        return self._hashing.get(role, (0, ""))[0]

    def of(self, role: str) -> list[bytes]:
        key = self._hashing.get(role)
        if key is None:
            return []
        if key not in self._by_hashing:
            self._by_hashing[key] = hash_request_blocks(
                self.request.prompt_token_ids,
                key[0],
                cache_salt=self.request.cache_salt,
                algo=key[1],
            )
        return self._by_hashing[key]


class ClusterRouting:
    def __init__(self, config: RoutingConfig, router: Router, pool_sizes: dict[str, int]) -> None:
        self.config = config
        self.name = config.resolve(pool_sizes)
        self.index = PrefixIndex() if self.name == "kv-aware" else None
        self.policy = RoutingPolicy(config, router, self.index, self.name)
        self.hit_error = HitErrorHistogram()
        self.notes = RouteNotes(self.name)
        self.subscriber: KVEventSubscriber | None = None
        self.peer_load: PeerLoadChannel | None = None  # several gateways: share_load
        self._hashing: dict[str, tuple[int, str]] = {}  # role -> (block size, algo)

    @property
    def needs_events(self) -> bool:
        return self.index is not None

    def start(
        self,
        ctx: Any,
        auth: Any,
        snapshot: Callable[[str], Awaitable[KVSnapshot]],
        malformed_frames: FrameCounters,
    ) -> asyncio.Task | None:
        """Open the event subscriber (kv-aware only); returns its reader task."""
        if self.index is None:
            return None
        self.subscriber = KVEventSubscriber(ctx, auth, self.index, snapshot, malformed_frames)
        return asyncio.create_task(self.subscriber.run())

    def share_load(self, directory: str, index: int) -> PeerLoadChannel | None:
        """Several gateways (``--api-server-count``): send this gateway's
        per-engine in-flight counts to the others through ``directory`` and
        add theirs to the router's figures (peer_load.py), every policy alike.
        Call on the running loop; ``close`` stops it. None (logged) when the
        channel cannot open: each gateway then routes on its own counts."""
        if self.peer_load is None:
            channel = PeerLoadChannel(directory, index, self.policy.router)
            try:
                channel.start()
            except (OSError, ValueError) as exc:
                channel.close()
                logger.warning("in-flight counts not shared with the other gateways: %s", exc)
                return None
            self.peer_load = channel
        return self.peer_load

    def load_changed(self) -> None:
        """The router's own in-flight counts changed (orchestration.py): the
        other gateways hear of it within peer_load.MIN_INTERVAL_S."""
        if self.peer_load is not None:
            self.peer_load.changed()

    def close(self) -> None:
        if self.subscriber is not None:
            self.subscriber.close()
        if self.peer_load is not None:
            self.peer_load.close()

    def on_connected(self, engine_id: str, role: str, info: dict[str, Any]) -> None:
        """A (new) incarnation answered ``ready``: follow its event stream."""
        if self.index is None:
            return
        self._hashing[role] = (info["block_size"], info["prefix_caching_hash_algo"])
        self.index.add_engine(engine_id, role, info["num_kv_blocks"])
        self.index.drop_engine_state(engine_id, info["epoch"])
        if self.subscriber is not None and info.get("kv_events_addr"):
            self.subscriber.connect(engine_id, info["kv_events_addr"])

    def on_removed(self, engine_id: str) -> None:
        """The engine left its pool (scaled in): stop following its events and
        forget what it held."""
        if self.subscriber is not None:
            self.subscriber.disconnect(engine_id)
        if self.index is not None:
            self.index.remove_engine(engine_id)

    def on_moved(self, engine_id: str, role: str, info: dict[str, Any]) -> None:
        """The engine serves in pool ``role`` now (cluster/disagg/pool_move.py): the
        blocks it caches are still there, so its entries stay; only its role changes."""
        if self.index is None:
            return
        self._hashing[role] = (info["block_size"], info["prefix_caching_hash_algo"])
        entry = self.index.engines.get(engine_id)
        if entry is not None:
            entry.role = role

    def hashes(self, request: EngineRequest) -> PromptHashes:
        return PromptHashes(request, self._hashing if self.index is not None else {})

    def choose(
        self, role: str, hashes: PromptHashes, exclude: set[str] = frozenset()
    ) -> Choice | None:
        choice = self.policy.choose(
            role,
            len(hashes.request.prompt_token_ids),
            hashes.of(role),
            exclude,
            block_size=hashes.block_size(role),
        )
        if choice is not None:
            self.notes.chosen(
                hashes.request.request_id, role, choice.engine.engine_id, choice.reason
            )
        return choice

    def plan(self, hashes: PromptHashes, wants_remote: bool) -> Plan | None:
        plan = self.policy.plan_disaggregated(
            len(hashes.request.prompt_token_ids),
            hashes.of("decode"),
            hashes.block_size("decode"),
            wants_remote,
        )
        if plan is not None:
            rid = hashes.request.request_id
            d = plan.decode
            self.notes.chosen(rid, "decode", d.engine.engine_id, d.reason)
            self.notes.planned(rid, plan.reason)
        return plan

    def plan_migration(
        self,
        hashes: PromptHashes,
        wants_remote: bool,
        handoff_min_tokens: int,
        exclude: set[str] = frozenset(),
    ) -> Plan | None:
        """``hashes`` of the resubmitted request (prompt + sent tokens):
        ``RoutingPolicy.plan_migration``, noted for the finished line."""
        plan = self.policy.plan_migration(
            len(hashes.request.prompt_token_ids),
            hashes.of("decode"),
            hashes.block_size("decode"),
            wants_remote,
            handoff_min_tokens,
            exclude,
        )
        if plan is not None:
            rid = hashes.request.request_id
            d = plan.decode
            self.notes.chosen(rid, "decode", d.engine.engine_id, d.reason)
            self.notes.planned(rid, plan.reason)
        return plan

    def tier_lender(
        self,
        hashes: PromptHashes,
        reader_role: str,
        lender_roles: tuple[str, ...],
        reader: Any,
        lender_ids: list[str],
    ) -> tuple[str, list[bytes]] | None:
        """The engine of ``lender_ids`` whose host tier holds the longest leading run of
        the prompt's blocks, longer than the reader's own (device and own tiers), and
        that run's hashes; None when none does better (``cluster/disagg/tier_lending.py``).
        The pools must hash alike (block size, algorithm)."""
        if self.index is None or not lender_ids:
            return None
        hashing = self._hashing.get(reader_role)
        if hashing is None or any(
            self._hashing.get(role, hashing) != hashing for role in lender_roles
        ):
            return None
        block_size = hashes.block_size(reader_role)
        cap = max_hit_blocks(len(hashes.request.prompt_token_ids), block_size)
        blocks = hashes.of(reader_role)[:cap]
        rid = reader.state.engine_id
        own = self.index.match_below(blocks, [rid], peers=False)[rid]
        runs = {eid: self.index.host_run(eid, blocks) for eid in lender_ids}
        best = max(sorted(runs), key=lambda eid: runs[eid])
        if runs[best] <= own:
            return None
        return best, blocks[: runs[best]]

    def count(self, role: str, reason: str) -> None:
        """A decision outside the policy's own (``decisions``: "role/reason")."""
        self.policy.decisions[(role, reason)] = self.policy.decisions.get((role, reason), 0) + 1

    def observe_hit(self, request_id: str, choice: Choice, reported_tokens: int) -> None:
        """The engine that computed the prompt reported its prefix hit."""
        if self.index is not None:
            self.hit_error.observe(choice.predicted_hit_tokens, reported_tokens)
        self.notes.hit(request_id, choice.predicted_hit_tokens, reported_tokens)

    def log_fields(self, request_id: str) -> dict[str, Any]:
        """The request's routing fields for its finished line (route_log.py);
        called once, when the request ended."""
        return self.notes.take(request_id)

    def decisions(self) -> dict[str, int]:
        """``"role/reason" -> count`` (``role`` "route" for the P-or-not plan)."""
        return {f"{r}/{why}": n for (r, why), n in sorted(self.policy.decisions.items())}
