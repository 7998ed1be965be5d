"""Operator views served by the gateway: ``GET /cluster/state`` (JSON,
``state.py``) and ``GET /dashboard`` (one self-contained HTML page,
``page.html``: plain JS and inline SVG, no build step, nothing fetched from
elsewhere), which polls ``/cluster/state``.

With an API key set, ``/cluster/state`` needs it like the ``/v1`` routes;
the page itself holds no data and is served to anyone: it asks for the key
when ``/cluster/state`` answers 401 and sends it as ``Authorization: Bearer``
(kept in the tab's ``sessionStorage`` only).
"""

from __future__ import annotations

from collections.abc import Callable
from importlib import resources
from typing import Any

import msgspec
from fastapi import FastAPI, Request, Response

from tandem.cluster.gateway.backend import Backend
from tandem.cluster.observability.dashboard.rolling import RollingStats
from tandem.cluster.observability.dashboard.state import cluster_state
from tandem.cluster.observability.metrics import GatewayMetrics

_PAGE = resources.files(__package__).joinpath("page.html")


def install(
    app: FastAPI,
    backend: Backend,
    metrics: GatewayMetrics,
    check_api_key: Callable[[Request], None],
    peers: Any = None,
) -> RollingStats:
    """Add the two routes to ``app``. The rolling sampler starts now if a
    loop runs, else with the first request to either route or ``/metrics``
    (uvicorn runs with lifespan off)."""
    rolling = RollingStats(metrics, peers=peers)  # several gateways: the cluster's window
    if peers is not None:
        peers.published["rolling"] = rolling.cumulative
    rolling.ensure_started()
    page = _PAGE.read_bytes()
    encoder = msgspec.json.Encoder()

    @app.get("/cluster/state")
    async def state(request: Request) -> Response:
        check_api_key(request)
        rolling.ensure_started()
        if peers is not None:
            peers.ensure_started()
        body = encoder.encode(cluster_state(backend, metrics, rolling, peers))
        return Response(body, media_type="application/json", headers=_NO_STORE)

    @app.get("/dashboard")
    async def dashboard() -> Response:
        rolling.ensure_started()
        return Response(page, media_type="text/html; charset=utf-8", headers=_PAGE_HEADERS)

    return rolling


_NO_STORE = {"Cache-Control": "no-store"}
# The page runs only its own inline script and talks only to this origin.
_PAGE_HEADERS = {
    **_NO_STORE,
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
        "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
}
