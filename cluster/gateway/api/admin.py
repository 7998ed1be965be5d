"""Operator calls on the gateway, behind their own key.

    POST /admin/drain    {"engine_id": "decode-0"}   -> 200 {"engine_id", "draining",
                                                          "migrated", "idle"}
    POST /admin/undrain  {"engine_id": "decode-0"}   -> 200 {"engine_id", "draining"}
    POST /admin/pools/{prefill|decode|colocated} {"engines": N}
                                                    -> 200 {"pool", "before", "engines",
                                                       "started", "stopped", "failed"}
    POST /admin/pools/move {"source_pool": "decode", "dest_pool": "prefill"(, "engine_id")}
                                                    -> 200 {"engine_id", "moved", "migrated",
                                                       "drain_s", "switch_s", "register_s",
                                                       "total_s", "error", ...}
    POST /reset_prefix_cache                        -> 200 {"reset": bool, "engines": {id: bool}}
    POST /start_profile                             -> 200 {"engines": {id: bool}}
    POST /stop_profile                              -> 200 {"engines": {id: trace path}}

The last three are vLLM's routes of the same names (benchmark clients such as
aiperf's ``--reset-kv-cache`` call them). ``/reset_prefix_cache`` makes
every engine drop the cached blocks no request uses (an engine with blocks
in use answers false and keeps its cache); the profile routes write torch
profiler traces per engine into ``--profile-dir`` (off without it: 400).
On several gateways (``--api-server-count``) any one of them acts on every
engine.

Both need ``Authorization: Bearer <admin key>`` (``--admin-api-key``; the API
key of ``/v1/*`` does not open them). Without an admin key configured the
routes answer 403: there is no open admin plane. Errors use the OpenAI error
envelope: 401 bad key, 400 malformed body or unknown ``engine_id``.
``tandem drain ENGINE_ID`` is the command-line client of the same call.

The pool route resizes a pool while serving (``cluster/disagg/scaling.py``):
new engines join once ready, removed ones are drained first (streams move
token-identically). It answers when the resize is done; a size outside the
pool's ``--{pool}-min-engines`` / ``--{pool}-max-engines`` is 400 naming the
flag, and an engine that failed to start is listed under ``failed`` (the
pool serves on with the others). ``tandem scale`` is its client.

The move route takes one engine out of a pool and puts the same process in
the other (``cluster/disagg/pool_move.py``): drained first (its streams
migrate), switched, registered again. 400 naming the field when refused (the
pools' engines differ: ``pool_moves``; a pool's last engine or its max: the
pool's flag); 200 with ``moved`` false and ``error`` when it could not move
(the engine serves on in its pool). ``tandem scale --move`` is its client.
"""

from __future__ import annotations

import hmac

import msgspec
from fastapi import FastAPI, Request
from starlette.responses import JSONResponse

from tandem.cluster.gateway.backend import Backend
from tandem.cluster.gateway.protocol import ProtocolError

MAX_ADMIN_BODY_BYTES = 4096


class DrainRequest(msgspec.Struct, forbid_unknown_fields=True):
    engine_id: str


class ScaleRequest(msgspec.Struct, forbid_unknown_fields=True):
    engines: int


class MoveRequest(msgspec.Struct, forbid_unknown_fields=True):
    source_pool: str
    dest_pool: str
    engine_id: str | None = None


MOVE_FIELDS = ("source_pool", "dest_pool", "engine_id", "pool_moves", "pool")


def add_admin_routes(app: FastAPI, backend: Backend, admin_api_key: str | None) -> None:
    expected = f"Bearer {admin_api_key}".encode() if admin_api_key else None

    def check_admin(request: Request) -> None:
        if expected is None:
            raise ProtocolError(
                "The admin API is off; start the server with --admin-api-key.",
                status_code=403,
                type="permission_error",
            )
        given = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(given, expected):
            raise ProtocolError(
                "Invalid or missing admin API key.",
                status_code=401,
                type="authentication_error",
                code="invalid_api_key",
            )

    async def parse(request: Request, kind: type = DrainRequest, param: str = "engine_id"):
        check_admin(request)
        body = await request.body()
        if len(body) > MAX_ADMIN_BODY_BYTES:
            raise ProtocolError(f"admin request body over {MAX_ADMIN_BODY_BYTES} bytes")
        try:
            return msgspec.json.decode(body, type=kind)
        except msgspec.DecodeError as exc:
            raise ProtocolError(f"invalid admin request: {exc}", param=param) from None

    @app.post("/admin/pools/move", include_in_schema=False)  # before /admin/pools/{pool}
    async def move_engine(request: Request) -> JSONResponse:
        req = await parse(request, MoveRequest, "source_pool")
        try:
            result = await backend.move_engine(req.source_pool, req.dest_pool, req.engine_id)
        except ValueError as exc:
            text = str(exc)
            param = next((f for f in MOVE_FIELDS if text.startswith(f + ":")), "source_pool")
            raise ProtocolError(text, param=param) from None
        return JSONResponse(result)

    @app.post("/admin/pools/{pool}", include_in_schema=False)
    async def scale_pool(pool: str, request: Request) -> JSONResponse:
        req = await parse(request, ScaleRequest, "engines")
        try:
            return JSONResponse(await backend.scale_pool(pool, req.engines))
        except ValueError as exc:
            text = str(exc)
            raise ProtocolError(
                text, param="pool" if text.startswith("pool:") else "engines"
            ) from None

    @app.post("/admin/drain", include_in_schema=False)
    async def drain(request: Request) -> JSONResponse:
        req = await parse(request)
        try:
            return JSONResponse(await backend.drain(req.engine_id))
        except ValueError as exc:
            raise ProtocolError(str(exc), param="engine_id") from None

    @app.post("/admin/undrain", include_in_schema=False)
    async def undrain(request: Request) -> JSONResponse:
        req = await parse(request)
        try:
            return JSONResponse(backend.undrain(req.engine_id))
        except ValueError as exc:
            raise ProtocolError(str(exc), param="engine_id") from None

    @app.post("/reset_prefix_cache", include_in_schema=False)
    async def reset_prefix_cache(request: Request) -> JSONResponse:
        check_admin(request)
        engines = await backend.reset_prefix_cache()
        return JSONResponse({"reset": all(engines.values()), "engines": engines})

    async def profile(request: Request, start: bool) -> JSONResponse:
        check_admin(request)
        try:
            engines = await backend.profile(start)
        except ValueError as exc:
            raise ProtocolError(str(exc), param="profile_dir") from None
        return JSONResponse({"engines": engines})

    @app.post("/start_profile", include_in_schema=False)
    async def start_profile(request: Request) -> JSONResponse:
        return await profile(request, True)

    @app.post("/stop_profile", include_in_schema=False)
    async def stop_profile(request: Request) -> JSONResponse:
        return await profile(request, False)
