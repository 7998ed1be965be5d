"""KVTransferParams: what travels in ``EngineRequest.kv_transfer_params``.

Two directions, one struct::

    gateway -> P  {"do_remote_decode": true}
    P -> gateway  {"do_remote_prefill": true, "remote_engine_id", "remote_epoch",
                   "remote_block_ids", "remote_request_id", "num_tokens",
                   "lease_remaining_s"}
    gateway -> D  the dict P returned, unchanged

``num_tokens`` is how many tokens' KV the blocks hold (P computed the prompt,
not its sampled first token). ``lease_remaining_s`` is a duration measured on
P's monotonic clock when P wrote the params: P frees the blocks that long
after unless D renews. D counts it from when it received the request, on
its own clock, minus a safety margin (``KVTransferConfig.lease_margin_s``),
so the two machines' clocks never need to agree.

No address travels: D looks ``(remote_engine_id, remote_epoch)`` up among
the prefill engines the cluster registered with it (``prefill_registry.py``)
and refuses the load when they are not there.

A prefill engine that borrows a prefix (a peer's host KV tier lent it,
``kvtransfer/tiers/export.py``) gets both directions in one request: the lent
prefix's params (``do_remote_prefill``, ``remote_medium: "host"``) and
``do_remote_decode``. It READs the prefix, computes the rest and then holds the
whole prompt for D like any prefill. Both flags are refused together for a
device-medium load (a decode request is never handed on).
"""

from __future__ import annotations

import re
from typing import Any

import msgspec

_PATH_RE = re.compile(r"at `\$\.?([^`]*)`")


class KVTransferParams(
    msgspec.Struct, omit_defaults=True, kw_only=True, forbid_unknown_fields=True
):
    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    remote_engine_id: str | None = None
    remote_block_ids: list[int] = []
    remote_request_id: str | None = None
    num_tokens: int = 0
    remote_epoch: int = 0
    lease_remaining_s: float = 0.0
    # "host": remote_block_ids are slots of the remote engine's host KV tier (a prefix
    # it exported, kvtransfer/tiers/export.py), not blocks of its device cache
    remote_medium: str = "device"

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict; fields at their default are left out."""
        return msgspec.to_builtins(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KVTransferParams:
        """Decode and validate. Raises ``ValueError`` naming the bad field."""
        if not isinstance(data, dict):
            raise ValueError(f"kv_transfer_params must be an object, got {type(data).__name__}")
        try:
            params = msgspec.convert(data, cls)
        except msgspec.ValidationError as e:
            raise ValueError(_explain(e)) from None
        params.validate()
        return params

    def validate(self) -> None:
        """Semantic checks beyond types. Raises ``ValueError`` naming the field."""
        if self.do_remote_decode and self.do_remote_prefill and self.remote_medium != "host":
            _bad(
                "do_remote_prefill",
                'cannot be set together with do_remote_decode unless remote_medium is "host" '
                "(a lent prefix read before a prefill)",
            )
        if self.num_tokens < 0:
            _bad("num_tokens", f"must be >= 0, got {self.num_tokens}")
        if self.remote_medium not in ("device", "host"):
            _bad("remote_medium", f'must be "device" or "host", got {self.remote_medium!r}')
        if self.remote_epoch < 0:
            _bad("remote_epoch", f"must be >= 0, got {self.remote_epoch}")
        for block_id in self.remote_block_ids:
            if block_id < 0:
                _bad("remote_block_ids", f"block ids must be >= 0, got {block_id}")
        if not self.do_remote_prefill:
            return
        for name in ("remote_engine_id", "remote_request_id"):
            if not getattr(self, name):
                _bad(name, "is required with do_remote_prefill")
        if self.num_tokens > 0 and not self.remote_block_ids:
            _bad("remote_block_ids", f"is empty but num_tokens={self.num_tokens}")
        if not self.lease_remaining_s > 0:
            _bad("lease_remaining_s", "is required (> 0) with do_remote_prefill")


def _bad(field: str, message: str) -> None:
    raise ValueError(f"kv_transfer_params.{field} {message}")


def _explain(error: msgspec.ValidationError) -> str:
    text = str(error)
    match = _PATH_RE.search(text)
    message = _PATH_RE.sub("", text).strip(" -")
    if match is None:  # unknown or missing field: msgspec names it in the message
        return f"invalid kv_transfer_params: {message}"
    return f"kv_transfer_params.{match.group(1)}: {message}"
