"""vLLM's engine admin routes on the real service (local Ray, 1 prefill + 1
decode engine, tiny): ``POST /reset_prefix_cache`` makes every engine drop
its unused cached blocks (the next identical prompt hits nothing), and
``/start_profile`` + ``/stop_profile`` write one torch profiler trace per
engine into ``--profile-dir``. Without the admin key they answer 401 (403
with no admin key configured) in the OpenAI envelope; with profiling off,
400 naming the flag."""

from __future__ import annotations

import json
import os

import httpx
import pytest

from tests import shared_ray
from tests.chaos.harness import serve_config

pytestmark = [pytest.mark.slow, pytest.mark.shared_ray]

KEY = "engine-admin-test-key"
ADMIN = {"Authorization": f"Bearer {KEY}"}
BODY = {"model": "tiny", "prompt": "a prompt long enough to fill some blocks " * 8,
        "max_tokens": 4, "temperature": 0.0}  # fmt: skip


def cached_tokens(url: str) -> int:
    r = httpx.post(url + "/v1/completions", json=BODY, timeout=60)
    assert r.status_code == 200, r.text
    return (r.json()["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)


def test_reset_prefix_cache_and_profile_routes(tmp_path):
    from tandem.cluster.cli.serve import ServiceThread

    traces = tmp_path / "traces"
    config = serve_config(
        f"admin-{os.getpid()}", decode=1, admin_api_key=KEY, profile_dir=str(traces)
    )
    shared_ray.start()
    try:
        with ServiceThread(config) as svc:
            url = svc.base_url
            for path in ("/reset_prefix_cache", "/start_profile", "/stop_profile"):
                r = httpx.post(url + path, timeout=30)
                assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
                r = httpx.post(url + path, headers={"Authorization": "Bearer no"}, timeout=30)
                assert r.status_code == 401

            cached_tokens(url)
            assert cached_tokens(url) > 0  # the second identical prompt hits the cache
            r = httpx.post(url + "/reset_prefix_cache", headers=ADMIN, timeout=30)
            assert r.status_code == 200, r.text
            assert r.json() == {"reset": True, "engines": {"prefill-0": True, "decode-0": True}}
            assert cached_tokens(url) == 0  # dropped everywhere

            r = httpx.post(url + "/start_profile", headers=ADMIN, timeout=60)
            assert r.status_code == 200 and r.json()["engines"] == {
                "prefill-0": True,
                "decode-0": True,
            }
            cached_tokens(url)
            r = httpx.post(url + "/stop_profile", headers=ADMIN, timeout=180)
            assert r.status_code == 200, r.text
            paths = r.json()["engines"]
            assert sorted(paths) == ["decode-0", "prefill-0"]
            for eid, path in paths.items():
                assert os.path.dirname(path) == str(traces) and eid in os.path.basename(path)
                with open(path) as f:
                    assert json.load(f)["traceEvents"]  # a Chrome trace with events
            assert svc.run(svc.service.backend.call_all("check_integrity")) == {
                "prefill-0": True,
                "decode-0": True,
            }
    finally:
        shared_ray.release()


def test_routes_refuse_without_admin_key_and_without_profile_dir():
    from tandem.cluster.gateway.app import create_app, serve_in_thread
    from tandem.cluster.gateway.null_backend import NullBackend
    from tandem.workers.checkpoints.tiny import build_tokenizer

    tok = build_tokenizer()
    with serve_in_thread(create_app(NullBackend(tok))) as url:  # no admin key: 403
        for path in ("/reset_prefix_cache", "/start_profile", "/stop_profile"):
            r = httpx.post(url + path, headers=ADMIN, timeout=10)
            assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"
    with serve_in_thread(create_app(NullBackend(tok), admin_api_key=KEY)) as url:
        r = httpx.post(url + "/reset_prefix_cache", headers=ADMIN, timeout=10)
        assert r.status_code == 200 and r.json() == {"reset": True, "engines": {}}
        r = httpx.post(url + "/start_profile", headers=ADMIN, timeout=10)
        assert r.status_code == 400 and r.json()["error"]["param"] == "profile_dir"
