"""The router's decision for one request, for its finished-request log line.

    plan / choose / observe_hit  --note-->  RouteNotes[request_id]
    gateway, request ended       --take-->  fields of the ``tandem.request`` line

Fields (absent when they did not happen):
    router                 the policy (round-robin | least-load | kv-aware)
    route_reason           P/D: the plan (remote_prefill, small_miss,
                           decode_holds_prompt, tiers_hold_prompt, short_prompt,
                           no_prefill;
                           after a migration migration_recompute or
                           migration_handoff);
                           colocated: the choice (prefix_hit, load, ...)
    prefill_engine, prefill_reason   the prefill engine that computed the prompt
    decode_engine, decode_reason     the decode engine (P/D)
    engine, engine_reason            the colocated engine
    predicted_hit_tokens   the router's prefix hit on the engine that computed the prompt
                           (a prefix a peer's host tier lent it included)
    actual_hit_tokens      that engine's reported hit (its first output)
    tier_lender, tier_lent_tokens    the engine whose host KV tier lent the engine that
                           computed the prompt a prefix, and its tokens
                           (cluster/disagg/tier_lending.py)

A migrated request's note describes its last attempt. Notes of requests
whose gateway never takes them (a backend driven without a gateway) are
dropped oldest first beyond ``max_notes``.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any


class RouteNotes:
    def __init__(self, policy: str, max_notes: int = 4096) -> None:
        self.policy = policy
        self.max_notes = max_notes
        self._notes: OrderedDict[str, dict[str, Any]] = OrderedDict()

    def _note(self, request_id: str) -> dict[str, Any]:
        note = self._notes.get(request_id)
        if note is None:
            note = self._notes[request_id] = {"router": self.policy}
            while len(self._notes) > self.max_notes:
                self._notes.popitem(last=False)
        return note

    def chosen(self, request_id: str, role: str, engine_id: str, reason: str) -> None:
        prefix = "" if role == "colocated" else f"{role}_"
        note = self._note(request_id)
        note[f"{prefix}engine"] = engine_id
        note[f"{prefix}engine_reason" if not prefix else f"{prefix}reason"] = reason
        if role == "colocated":
            note["route_reason"] = reason

    def planned(self, request_id: str, reason: str) -> None:
        note = self._note(request_id)
        note["route_reason"] = reason
        if reason != "remote_prefill":  # a retried attempt may have had a P
            note.pop("prefill_engine", None)
            note.pop("prefill_reason", None)

    def hit(self, request_id: str, predicted_tokens: int, actual_tokens: int) -> None:
        note = self._note(request_id)
        note["predicted_hit_tokens"] = predicted_tokens
        note["actual_hit_tokens"] = actual_tokens

    def lent(self, request_id: str, lender_id: str, num_tokens: int) -> None:
        note = self._note(request_id)
        note["tier_lender"] = lender_id
        note["tier_lent_tokens"] = num_tokens

    def take(self, request_id: str) -> dict[str, Any]:
        """The request's fields, forgotten here (empty if it was never routed)."""
        return self._notes.pop(request_id, {})

    def __len__(self) -> int:
        return len(self._notes)
