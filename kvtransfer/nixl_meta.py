"""What the NIXL connector's scheduler side tells its worker side each step.

Plain msgspec structs so the metadata can cross a process boundary with
the rest of ``SchedulerOutput`` if the runner ever lives elsewhere.
"""

from __future__ import annotations

import msgspec


class _Meta(msgspec.Struct, array_like=True, omit_defaults=True):
    pass


class PeerAddr(_Meta, frozen=True):
    """A prefill engine incarnation and where its side channels listen:
    ``port`` is its lead rank's (handshakes of rank 0, every notification),
    ``rank_ports[r]`` rank r's when it runs tensor-parallel (empty: one rank)."""

    engine_id: str
    epoch: int
    host: str
    port: int
    rank_ports: tuple[int, ...] = ()

    @property
    def tp_size(self) -> int:
        return max(1, len(self.rank_ports))

    def rank_port(self, rank: int) -> int:
        return self.rank_ports[rank] if self.rank_ports else self.port


class LoadSpec(_Meta):
    """Read ``remote_block_ids[i]`` of the peer into ``local_block_ids[i]``.

    ``error`` set means the scheduler side already knows the load cannot
    work (bad params, lease gone): the worker reports it failed at once.
    """

    request_id: str
    peer: PeerAddr
    remote_request_id: str
    local_block_ids: list[int]
    remote_block_ids: list[int]
    lease_deadline_mono: float  # D's monotonic clock: P may free the blocks after it
    error: str = ""
    # which of the peer's registered memories the remote ids index: "device" (its KV
    # cache) or "host" (its host KV tier's slots, kvtransfer/tiers/)
    remote_medium: str = "device"


class NotifySpec(_Meta):
    """A message to the peer about one of its held requests: ``done`` (free
    the blocks: nothing to read, or D gave up) or ``renew`` (extend the lease)."""

    request_id: str
    peer: PeerAddr
    remote_request_id: str
    kind: str  # NOTIF_DONE or NOTIF_RENEW


class SendSpec(_Meta):
    """P holds ``num_blocks`` blocks of ``request_id`` until D's ``done``
    notification or ``lease_deadline_mono`` (P's monotonic clock)."""

    request_id: str
    num_blocks: int
    lease_deadline_mono: float


class NixlConnectorMetadata(_Meta):
    loads: list[LoadSpec] = []
    notifies: list[NotifySpec] = []
    new_sends: list[SendSpec] = []
    cancelled_sends: list[str] = []
    # sends the engine freed since the last step (its lead rank reported them):
    # the other tensor-parallel ranks stop tracking them
    finished_sends: list[str] = []

    def is_empty(self) -> bool:
        return not (
            self.loads
            or self.notifies
            or self.new_sends
            or self.cancelled_sends
            or self.finished_sends
        )


NOTIF_DONE = "done"
NOTIF_RENEW = "renew"


class NotifKey(msgspec.Struct, array_like=True, frozen=True):
    """One notification as P's lead rank handles it: ``kind`` about its
    ``request_id``, sent by D's rank ``rank`` of ``num_ranks``. P frees a
    request once ``num_ranks`` distinct ranks said "done" (a D rank says it
    when ITS reads are over; one engine-wide "done" has num_ranks 1)."""

    kind: str
    request_id: str
    rank: int = 0
    num_ranks: int = 1


def encode_notif(kind: str, remote_request_id: str, rank: int = 0, num_ranks: int = 1) -> bytes:
    """``kind:id`` (one D rank) or ``kind@rank/num_ranks:id``."""
    if num_ranks == 1:
        return f"{kind}:{remote_request_id}".encode()
    return f"{kind}@{rank}/{num_ranks}:{remote_request_id}".encode()


def decode_notif(message: bytes) -> NotifKey | None:
    """The notification, or None for a message that is not ours."""
    head, sep, request_id = message.decode(errors="replace").partition(":")
    if not sep:
        return None
    kind, _, ranks = head.partition("@")
    if kind not in (NOTIF_DONE, NOTIF_RENEW):
        return None
    if not ranks:
        return NotifKey(kind, request_id)
    rank, _, num = ranks.partition("/")
    if not (rank.isdigit() and num.isdigit() and int(rank) < int(num)):
        return None
    return NotifKey(kind, request_id, int(rank), int(num))
