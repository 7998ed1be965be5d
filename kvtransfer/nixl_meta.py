"""What the NIXL connector's scheduler side tells its worker side each step.

Plain msgspec structs so the metadata can cross a process boundary with
the rest of ``SchedulerOutput`` if the runner ever lives elsewhere.
"""

from __future__ import annotations

import msgspec


class _Meta(msgspec.Struct, array_like=True, omit_defaults=True):
    pass


class PeerAddr(_Meta, frozen=True):
    """A prefill engine incarnation and where its side channel listens."""

    engine_id: str
    epoch: int
    host: str
    port: int


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

    def is_empty(self) -> bool:
        return not (self.loads or self.notifies or self.new_sends or self.cancelled_sends)


NOTIF_DONE = "done"
NOTIF_RENEW = "renew"


def encode_notif(kind: str, remote_request_id: str) -> bytes:
    return f"{kind}:{remote_request_id}".encode()


def decode_notif(message: bytes) -> tuple[str, str] | None:
    """``(kind, request_id)``, or None for a message that is not ours."""
    kind, sep, request_id = message.decode(errors="replace").partition(":")
    if not sep or kind not in (NOTIF_DONE, NOTIF_RENEW):
        return None
    return kind, request_id
