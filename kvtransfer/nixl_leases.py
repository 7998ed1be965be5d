"""Prefill role of the NIXL connector: the blocks held for decode engines' READs.

Per SendSpec, on every prefill rank (the progress poller runs while any is held: a decode
rank's connection needs this rank's UCX progress); the lead rank (0) alone answers for them:
it holds a send until "done" from every decode rank (a notification names its rank of how
many) -> done_sending, or until the lease deadline (extended by "renew") -> done_sending.
Other ranks drop a send when the engine freed it, it was cancelled, or its lease ended.
Deadlines are on the connector's monotonic clock.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from tandem.kvtransfer.config import KVTransferConfig
from tandem.kvtransfer.nixl_meta import NOTIF_RENEW, NixlConnectorMetadata, NotifKey

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class _Send:
    num_blocks: int
    lease_deadline_mono: float


class SendLeases:
    """The sends this rank holds, and which of them are over (``take_done``)."""

    def __init__(
        self, config: KVTransferConfig, clock: Callable[[], float], counters: dict[str, Any]
    ) -> None:
        self.config = config
        self._clock = clock
        self._counters = counters
        self._sends: dict[str, _Send] = {}
        self._early_done: dict[str, float] = {}  # "done" before the SendSpec arrived
        # decode ranks that said "done" so far, per request (and when the first did)
        self._done_ranks: dict[str, tuple[set[int], float]] = {}
        self.done_sending: set[str] = set()

    def any_held(self) -> bool:
        return bool(self._sends)

    def num_blocks_held(self) -> int:
        return sum(s.num_blocks for s in self._sends.values())

    def held(self) -> list[str]:
        return sorted(self._sends)

    def clear(self) -> None:
        self._sends.clear()

    def apply(self, metadata: NixlConnectorMetadata) -> bool:
        """This step's new, cancelled and finished sends; True when one was added."""
        lead = self.config.is_lead_rank
        added = False
        for send in metadata.new_sends:
            if lead and self._early_done.pop(send.request_id, None) is not None:
                self.done_sending.add(send.request_id)
            else:
                self._sends[send.request_id] = _Send(send.num_blocks, send.lease_deadline_mono)
                added = True
        dropped = (
            metadata.cancelled_sends if lead else metadata.cancelled_sends + metadata.finished_sends
        )
        for request_id in dropped:
            self._sends.pop(request_id, None)
            self._done_ranks.pop(request_id, None)
        return added

    def take_done(self) -> set[str]:
        done, self.done_sending = self.done_sending, set()
        return done

    def on_notifs(self, notes: list[NotifKey]) -> None:
        """Decode ranks' "renew" (extend the lease) and "done" (every rank's: free)."""
        now = self._clock()
        for note in notes:
            request_id = note.request_id
            send = self._sends.get(request_id)
            if note.kind == NOTIF_RENEW:
                if send is not None:
                    send.lease_deadline_mono = max(
                        send.lease_deadline_mono, now + self.config.lease_s
                    )
                    self._counters["num_lease_renewals"] += 1
                continue
            if note.num_ranks > 1:  # one decode rank of several: wait for all of them
                ranks, first_s = self._done_ranks.setdefault(request_id, (set(), now))
                ranks.add(note.rank)
                if len(ranks) < note.num_ranks:
                    continue
                del self._done_ranks[request_id]
            if send is not None:
                del self._sends[request_id]
                self.done_sending.add(request_id)
            else:
                self._early_done[request_id] = now

    def expire(self) -> None:
        """Sends past their lease end (the blocks are freed); old bookkeeping dropped."""
        now = self._clock()
        for request_id, send in list(self._sends.items()):
            if now >= send.lease_deadline_mono:
                del self._sends[request_id]
                self._done_ranks.pop(request_id, None)
                if not self.config.is_lead_rank:
                    continue  # the lead frees the engine's blocks
                self.done_sending.add(request_id)
                self._counters["num_lease_expiries"] += 1
                logger.info("lease of request %s expired: freeing its blocks", request_id)
        stale = [r for r, t in self._early_done.items() if now - t > self.config.lease_s]
        for request_id in stale:
            del self._early_done[request_id]
        stale = [r for r, (_, t) in self._done_ranks.items() if now - t > self.config.lease_s]
        for request_id in stale:
            del self._done_ranks[request_id]
