"""A CUDA graph capture while another thread of the process works on the GPU on its own
stream, as NIXL's progress thread or the connector's poller may (workers/graphs/runner.py,
``CAPTURE_ERROR_MODE``): the capture succeeds, the replay computes the captured function,
and the other thread's calls do not fail. Skipped without CUDA (tests/conftest.py)."""

from __future__ import annotations

import threading

import pytest
import torch

from tandem.workers.graphs.runner import CudaGraphBackend

pytestmark = pytest.mark.gpu


def test_capture_survives_side_stream_work_in_another_thread():
    device = torch.device("cuda")
    x = torch.arange(1024, dtype=torch.float32, device=device)
    out_static = torch.empty_like(x)
    stop, started = threading.Event(), threading.Event()
    errors: list[BaseException] = []
    num_rounds = [0]

    def side_worker() -> None:  # UCX-like: copies and event queries on a stream of its own
        stream = torch.cuda.Stream(device)
        src = torch.ones(1 << 16, device=device)
        dst = torch.empty_like(src)
        host = torch.empty(1 << 16, pin_memory=True)
        try:
            with torch.cuda.stream(stream):
                while not stop.is_set():
                    dst.copy_(src, non_blocking=True)
                    host.copy_(dst, non_blocking=True)
                    event = torch.cuda.Event()
                    event.record(stream)
                    event.query()
                    num_rounds[0] += 1
                    started.set()
        except BaseException as exc:  # noqa: BLE001 - reported by the assert below
            errors.append(exc)
            started.set()

    def forward() -> torch.Tensor:
        out_static.copy_(x * 2 + 1)
        return out_static

    thread = threading.Thread(target=side_worker, daemon=True)
    thread.start()
    try:
        assert started.wait(30)
        backend = CudaGraphBackend(device)
        rounds_before = num_rounds[0]
        replay = backend.capture(forward)
        x.copy_(torch.arange(1024, dtype=torch.float32, device=device) * 3)
        result = replay()
        torch.cuda.synchronize()
        assert torch.equal(result, x * 2 + 1)
        assert num_rounds[0] > rounds_before  # the other thread kept going meanwhile
    finally:
        stop.set()
        thread.join(30)
    assert not thread.is_alive()
    assert errors == [], errors
    backend.release()
