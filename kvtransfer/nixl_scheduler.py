"""Scheduler side of the NIXL connector: bookkeeping only, no I/O.

Prefill engine (P), a request sent with ``{"do_remote_decode": true}``::

    finishes LENGTH_CAPPED -> request_finished: delay_free, params for D,
                              SendSpec (blocks held until "done" or lease end)
    finishes any other way  -> nothing held, no params
    aborted while held      -> cancel_send: worker forgets the send

A prefill request may also carry a prefix lent from a peer's host KV tier
(``do_remote_prefill`` with ``remote_medium`` "host" beside ``do_remote_decode``,
``params.py``): it loads that prefix as D loads P's blocks (below), then finishes
and hands off as above.

Decode engine (D), a request sent with P's params (``do_remote_prefill``)::

    get_num_new_matched_tokens -> (num_tokens - local hit, async) or (0, False)
    update_state_after_alloc   -> LoadSpec for blocks [i0, i1) of the table,
                                  or a "done" notify when nothing is missing
    waiting for free blocks    -> "renew" notifies every lease_s / 3
    finished before any load   -> "done" notify so P frees at once (also when it was
                                  never scheduled: aborted while waiting)
    P not registered           -> a LoadSpec with an error: a load error

Leases are durations on each side's own monotonic clock (``clock``): P's
params carry ``lease_remaining_s``; D's deadline is its receipt time of the
request plus that, minus ``lease_margin_s`` (the trip P -> gateway -> D).

Block indices of a load (local hit ``L`` tokens, ``E`` external tokens)::

    i0 = L // block_size          (L is a multiple of block_size)
    i1 = ceil((L + E) / block_size)   the last block may be partial
    local block_ids[i0:i1] <- remote_block_ids[i0:i1]
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tandem.kvtransfer.base import KVConnectorSchedulerSide
from tandem.kvtransfer.config import KVTransferConfig
from tandem.kvtransfer.nixl_meta import (
    NOTIF_DONE,
    NOTIF_RENEW,
    LoadSpec,
    NixlConnectorMetadata,
    NotifySpec,
    PeerAddr,
    SendSpec,
)
from tandem.kvtransfer.params import KVTransferParams
from tandem.kvtransfer.prefill_registry import PrefillRegistry
from tandem.scheduler.request import RequestStatus

if TYPE_CHECKING:
    from tandem.scheduler.messages import KVConnectorOutput, SchedulerOutput
    from tandem.scheduler.request import Request

logger = logging.getLogger(__name__)

# phases of a decode-side request
_WAITING = "waiting"  # params seen, no blocks yet
_LOADING = "loading"  # LoadSpec issued
_SETTLED = "settled"  # nothing (more) to do: notified, or params unusable


@dataclasses.dataclass
class _RemoteRequest:
    params: KVTransferParams
    peer: PeerAddr
    lease_deadline_mono: float  # what D knows of P's lease, on D's monotonic clock
    last_renew_mono: float
    num_local_computed: int = 0
    phase: str = _WAITING
    error: str = ""  # params unusable: compute locally, only tell P to free
    refusal: str = ""  # P not registered: the load fails as a load error


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class NixlSchedulerSide(KVConnectorSchedulerSide):
    def __init__(
        self,
        config: KVTransferConfig,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.block_size = config.block_size
        self._clock = clock
        # decode side: prefill engines we may read from (set by the cluster)
        self.prefill_registry = PrefillRegistry()
        # decode side: requests with do_remote_prefill until request_finished
        self._remote: dict[str, _RemoteRequest] = {}
        self._loads_in_flight: set[str] = set()
        # prefill side: request id -> number of blocks held until finished_sending
        self._held_sends: dict[str, int] = {}
        # recorded since the last build_connector_meta
        self._loads: list[LoadSpec] = []
        self._notifies: list[NotifySpec] = []
        self._new_sends: list[SendSpec] = []
        self._cancelled_sends: list[str] = []
        self._finished_sends: list[str] = []

    # ---- decode side ------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_local_computed_tokens: int
    ) -> tuple[int, bool]:
        state = self._remote_state(request)
        if state is None or state.phase != _WAITING:
            return 0, False
        state.num_local_computed = num_local_computed_tokens
        if state.error:
            return 0, False
        # at least one token is computed locally: the step that produces logits
        num_remote = min(state.params.num_tokens, request.num_tokens - 1)
        num_external = max(0, num_remote - num_local_computed_tokens)
        return (num_external, True) if num_external > 0 else (0, False)

    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None:
        state = self._remote.get(request.request_id)
        if state is None or state.phase != _WAITING:
            return
        if num_external_tokens == 0:
            self._notify(request.request_id, state, NOTIF_DONE)
            state.phase = _SETTLED
            return
        num_local = state.num_local_computed
        i0 = num_local // self.block_size
        i1 = _cdiv(num_local + num_external_tokens, self.block_size)
        remote_ids = state.params.remote_block_ids
        error = ""
        if num_local % self.block_size:
            error = f"local hit of {num_local} tokens is not a multiple of {self.block_size}"
        elif i1 > len(block_ids) or i1 > len(remote_ids):
            error = (
                f"load needs blocks [{i0}, {i1}) but the request has {len(block_ids)} local "
                f"and {len(remote_ids)} remote blocks"
            )
        elif state.refusal:
            error = state.refusal
        elif self._clock() >= state.lease_deadline_mono:
            error = "the prefill engine's lease expired before the load could start"
        self._loads.append(
            LoadSpec(
                request.request_id,
                state.peer,
                state.params.remote_request_id or "",
                # on error the blocks are still named: the worker reports them
                # as load errors, so the scheduler never takes them for loaded KV
                list(block_ids[i0:i1]),
                list(remote_ids[i0:i1]) if not error else [],
                state.lease_deadline_mono,
                error,
                state.params.remote_medium,
            )
        )
        state.phase = _LOADING
        self._loads_in_flight.add(request.request_id)

    def loads_from_own_tiers(self, request: Request) -> bool:
        """Is ``request``'s load a prefix lent from a peer's host KV tier
        (``remote_medium`` "host", kvtransfer/tiers/export.py)? Like a tier hit its
        tokens count as cached and a bad block is recomputed whatever
        ``--load-failure-policy`` says: the prefix was a cache, the request can do
        without it."""
        state = self._remote.get(request.request_id)
        return state is not None and state.params.remote_medium == "host"

    def _remote_state(self, request: Request) -> _RemoteRequest | None:
        """The decode-side state of ``request``, created on first sight."""
        state = self._remote.get(request.request_id)
        if state is not None:
            return state
        raw = request.kv_transfer_params
        if not raw or not raw.get("do_remote_prefill") or not self.config.pulls_kv:
            return None
        try:
            params = KVTransferParams.from_dict(raw)
        except ValueError as e:
            logger.warning("request %s: ignoring kv_transfer_params: %s", request.request_id, e)
            return None
        engine_id = params.remote_engine_id or ""
        peer, refusal = self.prefill_registry.lookup(engine_id, params.remote_epoch)
        if peer is None:  # nothing is sent anywhere for it (no address to send to)
            peer = PeerAddr(engine_id, params.remote_epoch, "", 0)
            logger.warning("request %s: refusing its KV load: %s", request.request_id, refusal)
        # P's lease, counted from when this engine received the request
        deadline = request.arrival_mono + params.lease_remaining_s
        deadline -= self.config.resolved_lease_margin_s
        renewed = request.arrival_mono + params.lease_remaining_s - self.config.lease_s
        state = _RemoteRequest(params, peer, deadline, renewed, refusal=refusal)
        num_needed = _cdiv(params.num_tokens, self.block_size)
        if len(params.remote_block_ids) < num_needed:
            state.error = (
                f"{len(params.remote_block_ids)} remote blocks cannot hold {params.num_tokens} "
                f"tokens of {self.block_size}"
            )
            logger.warning("request %s: recomputing locally: %s", request.request_id, state.error)
        self._remote[request.request_id] = state
        return state

    def _notify(self, request_id: str, state: _RemoteRequest, kind: str) -> None:
        self._notifies.append(
            NotifySpec(request_id, state.peer, state.params.remote_request_id or "", kind)
        )

    def _renew_leases(self, now: float) -> None:
        """Renew P's lease for requests still waiting for blocks (``now`` on
        D's monotonic clock). P extends to its receipt time + lease_s, which
        is later than D's send time + lease_s, so D's new view is safe. A
        renewal sent too close to the known deadline might arrive after P
        freed the blocks, so it is sent but not counted."""
        lease_s = self.config.lease_s
        margin_s = min(lease_s / 4, 5.0)
        for request_id, state in self._remote.items():
            if state.phase != _WAITING or state.refusal:
                continue
            if now - state.last_renew_mono < lease_s / 3:
                continue
            self._notify(request_id, state, NOTIF_RENEW)
            state.last_renew_mono = now
            if state.lease_deadline_mono - now > margin_s:
                state.lease_deadline_mono = now + lease_s

    def set_prefill_endpoints(self, endpoints: list[Any]) -> None:
        """The cluster's registered prefill engines (the whole list each time,
        see ``prefill_registry.py``). Raises ``ValueError`` on a bad entry."""
        self.prefill_registry.replace(endpoints)

    # ---- prefill side -----------------------------------------------------------

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        # a request finished before it was ever considered (aborted while waiting):
        # its state is made now, so the peer hears "done" at once, not at its lease's end
        state = self._remote_state(request)
        self._remote.pop(request.request_id, None)
        if state is not None:
            if state.phase == _WAITING and not state.refusal:  # no load: let P free now
                self._notify(request.request_id, state, NOTIF_DONE)
            if not state.params.do_remote_decode:
                return False, None
            # a prefill that borrowed its prefix (a peer's host tier) hands off as any
        raw = request.kv_transfer_params
        if not raw or not raw.get("do_remote_decode") or not self.config.serves_kv:
            return False, None
        if request.status != RequestStatus.FINISHED_LENGTH_CAPPED:
            return False, None  # EOS on the first token, abort, error: nothing to hand off
        num_tokens = request.num_computed_tokens
        num_blocks = _cdiv(num_tokens, self.block_size)
        if num_tokens <= 0 or num_blocks > len(block_ids):
            logger.error(
                "request %s: cannot hand off %d tokens from %d blocks",
                request.request_id,
                num_tokens,
                len(block_ids),
            )
            return False, None
        lease_deadline_mono = self._clock() + self.config.lease_s
        self._new_sends.append(SendSpec(request.request_id, num_blocks, lease_deadline_mono))
        self._held_sends[request.request_id] = num_blocks
        params = KVTransferParams(
            do_remote_prefill=True,
            remote_engine_id=self.config.engine_id,
            remote_block_ids=list(block_ids[:num_blocks]),
            remote_request_id=request.request_id,
            num_tokens=num_tokens,
            remote_epoch=self.config.epoch,
            lease_remaining_s=self.config.lease_s,
        )
        return True, params.to_dict()

    def hold_blocks(
        self, hold_id: str, block_ids: list[int], num_tokens: int, remote_medium: str
    ) -> dict[str, Any]:
        """Hold blocks that belong to no request (a host tier export,
        kvtransfer/tiers/export.py) for a peer's READ, like a finished prefill's:
        under ``hold_id`` until the peer's "done" or the lease's end
        (``finished_sending``). The params for the reading engine's request."""
        if not self.config.serves_kv:
            raise ValueError(f"engine {self.config.engine_id} does not serve KV (its role)")
        lease_deadline_mono = self._clock() + self.config.lease_s
        self._new_sends.append(SendSpec(hold_id, len(block_ids), lease_deadline_mono))
        self._held_sends[hold_id] = len(block_ids)
        params = KVTransferParams(
            do_remote_prefill=True,
            remote_engine_id=self.config.engine_id,
            remote_block_ids=list(block_ids),
            remote_request_id=hold_id,
            num_tokens=num_tokens,
            remote_epoch=self.config.epoch,
            lease_remaining_s=self.config.lease_s,
            remote_medium=remote_medium,
        )
        return params.to_dict()

    def cancel_send(self, request_id: str) -> None:
        if self._held_sends.pop(request_id, None) is None:
            return
        pending = [s for s in self._new_sends if s.request_id != request_id]
        if len(pending) == len(self._new_sends):
            self._cancelled_sends.append(request_id)  # the worker already tracks it
        self._new_sends = pending

    # ---- both -------------------------------------------------------------------

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> NixlConnectorMetadata:
        self._renew_leases(self._clock())
        meta = NixlConnectorMetadata(
            loads=self._loads,
            notifies=self._notifies,
            new_sends=self._new_sends,
            cancelled_sends=self._cancelled_sends,
            finished_sends=self._finished_sends,
        )
        self._loads, self._notifies, self._new_sends, self._cancelled_sends = [], [], [], []
        self._finished_sends = []
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        for request_id in connector_output.finished_sending:
            if self._held_sends.pop(request_id, None) is not None and self.config.tp_size > 1:
                self._finished_sends.append(request_id)  # tells the other ranks
        for request_id in connector_output.finished_recving:
            self._loads_in_flight.discard(request_id)

    def has_pending_work(self) -> bool:
        return bool(
            self._held_sends
            or self._loads_in_flight
            or self._loads
            or self._notifies
            or self._new_sends
            or self._cancelled_sends
            or self._finished_sends
        )

    @property
    def num_blocks_held_for_transfer(self) -> int:
        """Blocks this (prefill) engine keeps for decode engines to pull."""
        return sum(self._held_sends.values())

    def check_integrity(self) -> None:
        """Idle engine: nothing held, nothing in flight, no request tracked."""
        problems = {
            "held sends": sorted(self._held_sends),
            "loads in flight": sorted(self._loads_in_flight),
            "tracked decode requests": sorted(self._remote),
        }
        leftovers = {k: v for k, v in problems.items() if v}
        if leftovers:
            raise AssertionError(f"NixlSchedulerSide not idle: {leftovers}")
