"""Registering prefill engines with the engines that read their KV.

Decode engines read KV only from prefill engines the cluster registered
(``kvtransfer/prefill_registry.py``). After every health round the backend
compares the registered list with what each decode engine last received and
pushes the whole list where it differs::

    P ready / restarted (engine id, epoch, kv address from ready())
      -> D.set_prefill_endpoints([[engine_id, epoch, host, port], ...])
      -> only then does the router send P requests (a handoff never names
         an incarnation D has not been told about)

Engines that keep a host KV tier serve their KV too (kv role "both",
``workers/parallel/connector_hook.py``): a decode engine with one reports a KV
address and so joins the list, and a prefill engine with one gets the list as
well, so each reads the others' lent tier prefixes (``cluster/disagg/tier_lending.py``).

Runs on the gateway's event loop; every call has a deadline.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

logger = logging.getLogger(__name__)

Endpoint = list[Any]  # [engine_id, epoch, host, port(, rank_ports)]


PD_ROLES = ("prefill", "decode")


def prefill_endpoints(engines: list[Any], roles: tuple[str, ...] = PD_ROLES) -> list[Endpoint]:
    """The registered list: engines of ``roles`` (prefill, and decode engines with a
    host KV tier; colocated ones lending their host KV tiers to each other) that
    reported a KV address at their current epoch (``state.info`` from ``ready()``),
    sorted by id."""
    out = []
    for e in engines:
        st = e.state
        address = st.info.get("kv_address") if st.info else None
        if st.role in roles and st.epoch and address:
            endpoint = [st.engine_id, st.epoch, address[0], int(address[1])]
            rank_ports = st.info.get("kv_rank_ports")
            if rank_ports:  # a tensor-parallel engine: every rank's side channel
                endpoint.append(list(rank_ports))
            out.append(endpoint)
    return sorted(out)


async def push_prefill_endpoints(
    decode_engines: list[Any],
    all_engines: list[Any],
    call: Callable[[Any, list[Endpoint]], Awaitable[Any]],
    timeout_s: float,
    roles: tuple[str, ...] = PD_ROLES,
) -> bool:
    """Send the registered list (from ``all_engines``) to every decode engine
    whose last acknowledged ``(epoch, list)`` (``e.pushed_endpoints``)
    differs. True when all of ``decode_engines`` hold the current list; a
    failed push is retried on the next round."""
    endpoints = prefill_endpoints(all_engines, roles)
    targets = [
        e
        for e in decode_engines
        if e.state.epoch and e.pushed_endpoints != (e.state.epoch, endpoints)
    ]

    async def push(e: Any) -> bool:
        try:
            await asyncio.wait_for(call(e, endpoints), timeout_s)
        except Exception as exc:  # noqa: BLE001 - retried next round
            logger.warning("registering prefill engines with %s failed: %s", e.state.engine_id, exc)
            return False
        e.pushed_endpoints = (e.state.epoch, endpoints)
        return True

    results = await asyncio.gather(*(push(e) for e in targets))
    return all(results)
