"""Helpers shared by the tests that run a real ``ServiceThread``."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai

from tests import shared_ray

BUSY_FIELDS = (
    "num_running_reqs",
    "num_waiting_reqs",
    "num_waiting_for_remote_kvs",
    "num_blocks_held_for_transfer",
)


def client(svc, timeout_s: float = 60.0) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=svc.base_url + "/v1", api_key="x", max_retries=0, timeout=timeout_s
    )


def disconnect_mid_stream(svc, body: dict, num_events: int, timeout_s: float = 30.0) -> None:
    """Stream ``body`` from /v1/completions and close the connection after
    ``num_events`` data events (a client that goes away mid-stream)."""
    with httpx.Client(timeout=timeout_s) as h:
        with h.stream("POST", svc.base_url + "/v1/completions", json=body) as r:
            got = 0
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    got += 1
                if got >= num_events:
                    break


def wait_idle(svc, deadline_s: float = 30.0) -> dict:
    """Every engine idle (nothing running, waiting or held for a transfer),
    then check_integrity() on each; returns the last ``EngineStats`` by engine."""
    end = time.monotonic() + deadline_s
    while True:
        stats = svc.run(svc.service.backend.call_all("stats"))
        busy = {e: s for e, s in stats.items() if any(getattr(s.scheduler, k) for k in BUSY_FIELDS)}
        if not busy:
            break
        assert time.monotonic() < end, f"engines not idle: {busy}"
        time.sleep(0.1)
    assert all(svc.run(svc.service.backend.call_all("check_integrity")).values())
    return stats


@contextlib.contextmanager
def tiny_pd_service(disagg_min_tokens: int = 32, tracer: Any = None, **options: Any) -> Iterator:
    """A 1 prefill + 1 decode ``ServiceThread`` of the tiny model on the test
    process's shared local Ray (tests/shared_ray.py: mark the module
    ``shared_ray``); prompts of ``disagg_min_tokens`` or more take the remote path; ``tracer`` as ``ServiceThread``'s; ``options``: more serve
    settings."""
    from tandem.cluster.cli.serve import ServiceThread
    from tandem.cluster.cli.settings import serve_config

    config = serve_config(
        model="tiny",
        ray_dashboard=False,
        prefill=1,
        decode=1,
        disagg_min_tokens=disagg_min_tokens,
        num_kv_blocks=256,
        max_num_seqs=16,
        max_model_len=512,
        **options,
    )
    shared_ray.start()
    try:
        with ServiceThread(config, tracer=tracer) as svc:
            yield svc
    finally:
        shared_ray.release()
