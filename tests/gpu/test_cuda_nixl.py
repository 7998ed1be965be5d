"""NIXL between two processes with the KV caches in VRAM (issue #10): the
READ is byte-exact, lands while the prefill loop is blocked, and the
start-up probe finds a GPU transport (CUDA IPC), not TCP, with the UCX
settings the connector fills in. Skipped without CUDA (tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

from tests.kvtransfer.prefill_process import PrefillProcess, kv_content
from tests.kvtransfer.test_progress_while_blocked import COMMON, P_SHAPE, Decode

pytestmark = pytest.mark.gpu

VRAM = {"device": "cuda:0"}


def test_vram_read_byte_exact_while_prefill_blocked_over_a_gpu_transport():
    d = Decode(engine_id="d-vram", transport_probe="on", **VRAM)
    p = PrefillProcess({"engine_id": "p-vram", **COMMON, **VRAM}, P_SHAPE, seed=5)
    try:
        d.scheduler.set_prefill_endpoints([p.endpoint])
        p_blocks, d_blocks = [5, 6, 7, 12, 13, 3], [10, 11, 2, 3, 4, 20]
        params = p.finish("warm", 8, [30, 31])
        req = d.start("warm", params, [38, 39])
        assert d.received_all({"warm"}, 60.0) == {"warm"}
        d.finish(req, [38, 39])
        p.wait_done_sending("warm")

        params = p.finish("r", 23, p_blocks)
        p.block(5.0, "python")  # a long forward on P
        req = d.start("r", params, d_blocks)
        assert d.received_all({"r"}, 3.0) == {"r"}, "VRAM READ pending while P was blocked"
        p_kv = kv_content(P_SHAPE, seed=5)
        for local, remote in zip(d_blocks, p_blocks):
            assert torch.equal(d.kv[local].cpu().view(torch.uint8), p_kv[remote].view(torch.uint8))
        d.finish(req, d_blocks)
        p.wait_done_sending("r", timeout_s=30)

        report = d.worker._transport_probe.wait(180.0)
        assert report is not None and report.memory == "VRAM"
        assert not report.over_tcp and not report.emulated, report
        assert "cuda_ipc" in report.transport, report
        d.close()
    finally:
        p.close()
        d.worker.shutdown()
