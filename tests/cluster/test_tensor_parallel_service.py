"""A tensor-parallel engine in the real service (local Ray, one colocated
engine of two ranks; P/D across TP sizes is tests/e2e/test_pd_tensor_parallel.py):
it gives one TP=1 engine's greedy text, and a worker killed between steps
fails the engine as one unit, which Ray restarts with a new epoch that
serves again."""

from __future__ import annotations

import os
import signal
import time

import pytest

from cluster.placement import resolve_placement
from cluster.serve import SERVE_DEFAULTS, ServiceThread
from scheduler.messages import SamplingParams
from tests.cluster.service_helpers import client, wait_idle
from tests.cluster.test_service import ray_local  # noqa: F401 - the module's local Ray
from workers.config import EngineConfig
from workers.llm import LLM

pytestmark = pytest.mark.slow

ENGINE = {"num_kv_blocks": 128, "max_num_seqs": 8, "max_model_len": 512, "tensor_parallel_size": 2}
PROMPT = "Tensor parallel engines split every layer over their ranks. " * 2


@pytest.fixture(scope="module")
def svc(request):
    request.getfixturevalue("ray_local")
    settings = dict(
        SERVE_DEFAULTS, ray_dashboard=False, model="tiny", colocated=1, prefill=0, decode=0
    )
    per_role = {r: dict(ENGINE) for r in ("prefill", "decode", "colocated")}
    resolve_placement(settings)
    with ServiceThread(settings, per_role) as service:
        yield service


def complete(svc) -> str:
    out = client(svc).completions.create(
        model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    return out.choices[0].text


def expected_text() -> str:
    with LLM(EngineConfig(model="tiny", num_kv_blocks=64)) as llm:
        sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        return llm.generate([PROMPT], sp)[0].text


def test_two_rank_engine_equals_one_rank(svc):
    assert complete(svc) == expected_text()
    wait_idle(svc)


def test_killed_worker_restarts_the_engine_with_a_new_epoch(svc):
    e = svc.service.backend.engines["colocated-0"]
    epoch, (worker_pid,) = e.state.epoch, e.state.info["tp_worker_pids"]
    os.kill(worker_pid, signal.SIGKILL)
    end = time.monotonic() + 120
    while e.state.epoch == epoch or not e.state.info or not e.state.info.get("tp_worker_pids"):
        assert time.monotonic() < end, "colocated-0 did not come back"
        time.sleep(0.1)
    assert e.state.info["tp_worker_pids"] != [worker_pid]
    assert complete(svc) == expected_text()
    wait_idle(svc)
