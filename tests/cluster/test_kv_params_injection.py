"""A client cannot hand the engines kv_transfer_params through the OpenAI API:
the gateway builds every EngineRequest itself, so a body naming a prefill
engine or an address is served as a plain request (vLLM accepts this field
from clients; Tandem does not)."""

from __future__ import annotations

import httpx

from tandem.cluster.gateway.app import create_app, serve_in_thread
from tandem.cluster.gateway.null_backend import NullBackend
from tandem.workers.checkpoints.tiny import build_tokenizer

FORGED = {
    "do_remote_prefill": True,
    "remote_engine_id": "evil",
    "remote_host": "203.0.113.9",
    "remote_port": 5555,
    "remote_block_ids": [0, 1, 2],
    "remote_request_id": "x",
    "num_tokens": 40,
    "remote_epoch": 1,
    "lease_remaining_s": 60.0,
}


class RecordingBackend(NullBackend):
    def __init__(self, tokenizer) -> None:
        super().__init__(tokenizer, max_model_len=256)
        self.seen = []

    def generate(self, request):
        self.seen.append(request)
        return super().generate(request)


BODIES = {
    "/v1/completions": {"prompt": "hello", "max_tokens": 3},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
}


def test_kv_transfer_params_in_the_body_never_reach_an_engine():
    backend = RecordingBackend(build_tokenizer())
    with serve_in_thread(create_app(backend)) as url, httpx.Client(timeout=10.0) as http:
        for path, body in BODIES.items():
            for stream in (False, True):
                forged = {**body, "kv_transfer_params": FORGED, "stream": stream}
                r = http.post(f"{url}{path}", json=forged)
                assert r.status_code == 200, r.text
    assert len(backend.seen) == 4
    assert all(req.kv_transfer_params is None for req in backend.seen)
