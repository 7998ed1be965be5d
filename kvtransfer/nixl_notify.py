"""Messages from a decode rank to a prefill engine's lead rank ("done", "renew"): over the ZMQ
side channel by default, or as NIXL notifications (``notification_transport``); P accepts both.
Never blocks; a failure is counted and P's lease frees the blocks anyway."""

from __future__ import annotations

import logging
from typing import Any

from tandem.kvtransfer.config import KVTransferConfig
from tandem.kvtransfer.nixl_agent import NixlAgent
from tandem.kvtransfer.nixl_meta import PeerAddr, encode_notif
from tandem.kvtransfer.nixl_peers import PeerTable
from tandem.kvtransfer.side_channel import Notification, NotificationSender

logger = logging.getLogger(__name__)


class PrefillNotifier:
    """Sends this rank's notifications to prefill engines; counts sent and failed."""

    def __init__(
        self,
        config: KVTransferConfig,
        agent: NixlAgent,
        peers: PeerTable,
        sender: NotificationSender,
        counters: dict[str, Any],
    ) -> None:
        self.config = config
        self.agent = agent
        self._peers = peers
        self._notifier = sender
        self._counters = counters

    def notify(
        self, addr: PeerAddr, kind: str, remote_request_id: str, rank_done: bool = False
    ) -> None:
        """Tell P's lead rank ``kind`` about its request; never blocks, failures
        are counted (P's lease still frees the blocks). ``rank_done``: this
        rank's reads are over, P waits for every decode rank's; else the
        message speaks for the whole engine."""
        ok = False
        if not addr.host:  # P was never registered: there is nobody to tell
            return
        rank, num_ranks = (self.config.tp_rank, self.config.tp_size) if rank_done else (0, 1)
        lead = self._peers.find(addr, 0) if self.config.notification_transport == "nixl" else None
        if lead is None or not lead.ready:  # the side channel, or no NIXL peer to use
            message = Notification(
                addr.engine_id, addr.epoch, kind, remote_request_id, rank, num_ranks
            )
            ok = self._notifier.send(addr.host, addr.port, message)
        else:
            try:
                message = encode_notif(kind, remote_request_id, rank, num_ranks)
                self.agent.send_notif(lead.agent_name, message)
                ok = True
            except Exception as e:
                logger.warning("NIXL notification to %s failed: %r", addr.engine_id, e)
        if ok:
            self._counters["num_notifs_sent"] += 1
        else:
            self._counters["num_notif_failures"] += 1
