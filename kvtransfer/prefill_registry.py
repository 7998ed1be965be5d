"""The prefill engines a decode engine may read KV from.

D never takes an address from a request: ``kv_transfer_params`` name a
prefill engine by ``(remote_engine_id, remote_epoch)`` only, and D looks
its side channel up here. The cluster (``RayBackend``) fills the registry
through a control call whenever a prefill engine becomes ready or restarts::

    router: P ready (engine id, epoch, kv address)
        -> every decode/colocated engine: set_prefill_endpoints([...])
    request params {remote_engine_id, remote_epoch, ...}
        -> registry.lookup -> PeerAddr | refusal (a load error, with the reason)

A request naming an engine or epoch that is not registered is refused, so a
forged request cannot make D pull bytes from a host of its choosing into
its prefix cache.
"""

from __future__ import annotations

from typing import Any

import msgspec

from tandem.kvtransfer.nixl_meta import PeerAddr


class PrefillEndpoint(msgspec.Struct, array_like=True, frozen=True):
    """One registered prefill engine incarnation and its side channel(s):
    ``port`` is rank 0's; a tensor-parallel engine also lists every rank's
    (``rank_ports[0] == port``), one side channel per worker rank."""

    engine_id: str
    epoch: int
    host: str
    port: int
    rank_ports: tuple[int, ...] = ()

    @classmethod
    def parse(cls, raw: Any) -> PrefillEndpoint:
        """From a struct, a dict or a ``[engine_id, epoch, host, port(,
        rank_ports)]`` list. Raises ``ValueError`` naming the bad field."""
        if isinstance(raw, PrefillEndpoint):
            return raw
        try:
            ep = msgspec.convert(raw, cls, strict=True)
        except msgspec.ValidationError as e:
            raise ValueError(f"invalid prefill endpoint {raw!r}: {e}") from None
        if not ep.engine_id:
            raise ValueError("prefill endpoint engine_id must not be empty")
        if ep.epoch < 0:
            raise ValueError(f"prefill endpoint epoch must be >= 0, got {ep.epoch}")
        if not ep.host:
            raise ValueError("prefill endpoint host must not be empty")
        if not 0 < ep.port < 65536:
            raise ValueError(f"prefill endpoint port must be in 1..65535, got {ep.port}")
        if ep.rank_ports:
            if ep.rank_ports[0] != ep.port or not all(0 < p < 65536 for p in ep.rank_ports):
                raise ValueError(
                    f"prefill endpoint rank_ports must be ports starting with port {ep.port}, "
                    f"got {list(ep.rank_ports)}"
                )
        return ep


class PrefillRegistry:
    """engine id -> its registered incarnation. Owned by the engine loop thread."""

    def __init__(self) -> None:
        self._endpoints: dict[str, PrefillEndpoint] = {}

    def replace(self, endpoints: list[Any]) -> None:
        """Set the whole list (the cluster always sends all of it). Invalid
        entries raise ``ValueError`` and leave the registry unchanged."""
        parsed = [PrefillEndpoint.parse(raw) for raw in endpoints]
        by_id = {ep.engine_id: ep for ep in parsed}
        if len(by_id) != len(parsed):
            raise ValueError("prefill endpoints name an engine id twice")
        self._endpoints = by_id

    def lookup(self, engine_id: str, epoch: int) -> tuple[PeerAddr | None, str]:
        """``(peer, "")`` for a registered incarnation, else ``(None, reason)``."""
        ep = self._endpoints.get(engine_id)
        if ep is None:
            known = sorted(self._endpoints)
            return None, (
                f"prefill engine {engine_id!r} is not registered with this engine "
                f"(registered: {known})"
            )
        if ep.epoch != epoch:
            return None, (
                f"prefill engine {engine_id!r} epoch {epoch} is not its registered epoch "
                f"{ep.epoch} (restarted or never seen)"
            )
        return PeerAddr(ep.engine_id, ep.epoch, ep.host, ep.port, ep.rank_ports), ""

    def endpoints(self) -> list[PrefillEndpoint]:
        return sorted(self._endpoints.values(), key=lambda ep: ep.engine_id)
