"""The admin plane's refusals (cluster/gateway/api/admin.py), in process: off without
``--admin-api-key`` (403), the /v1 API key does not open it (401), bad bodies
are 400 naming the field; every refusal in the OpenAI error envelope. The
drain itself runs against the real service in tests/cluster/test_drain.py."""

from __future__ import annotations

import httpx
import pytest

from tandem.cluster.gateway.app import create_app, serve_in_thread
from tandem.cluster.gateway.null_backend import NullBackend
from tandem.workers.checkpoints.tiny import build_tokenizer


@pytest.fixture(scope="module")
def urls():
    tokenizer = build_tokenizer()
    with (
        serve_in_thread(create_app(NullBackend(tokenizer))) as off,
        serve_in_thread(
            create_app(NullBackend(tokenizer), api_key="user-key", admin_api_key="admin-key")
        ) as on,
    ):
        yield off, on


def post(url: str, body: bytes | dict, key: str | None) -> tuple[int, dict]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    kw = {"json": body} if isinstance(body, dict) else {"content": body}
    r = httpx.post(url + "/admin/drain", headers=headers, timeout=30, **kw)
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    return r.status_code, error


def test_admin_plane_off_without_a_key(urls):
    off, _ = urls
    for key in (None, "anything"):
        status, error = post(off, {"engine_id": "decode-0"}, key)
        assert (status, error["type"]) == (403, "permission_error")
        assert "--admin-api-key" in error["message"]


def test_admin_refusals(urls):
    _, on = urls
    assert post(on, {"engine_id": "decode-0"}, None)[0] == 401
    assert post(on, {"engine_id": "decode-0"}, "user-key")[0] == 401  # the /v1 key
    status, error = post(on, {"engine": "decode-0"}, "admin-key")
    assert (status, error["param"]) == (400, "engine_id")
    assert post(on, b"not json", "admin-key")[0] == 400
    assert post(on, b"x" * 5000, "admin-key")[0] == 400
    status, error = post(on, {"engine_id": "decode-0"}, "admin-key")  # no engines here
    assert (status, error["param"]) == (400, "engine_id")


def test_pool_resize_refusals(urls):
    """``POST /admin/pools/{pool}``: the admin key, a body naming ``engines``,
    and a backend without pools answers 400 naming ``pool``."""
    off, on = urls

    def scale(url: str, body, key: str | None) -> tuple[int, dict]:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        kw = {"json": body} if isinstance(body, dict) else {"content": body}
        r = httpx.post(url + "/admin/pools/decode", headers=headers, timeout=30, **kw)
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        return r.status_code, error

    assert scale(off, {"engines": 2}, "anything")[0] == 403
    assert scale(on, {"engines": 2}, None)[0] == 401
    assert scale(on, {"engines": 2}, "user-key")[0] == 401
    for body in ({"engine": 2}, {"engines": "2"}, b"[]"):
        status, error = scale(on, body, "admin-key")
        assert (status, error["param"]) == (400, "engines"), (body, error)
    status, error = scale(on, {"engines": 2}, "admin-key")  # NullBackend: no pools
    assert (status, error["param"]) == (400, "pool"), error
