"""``tandem serve`` (the real service on a local Ray: engine actors, gateway,
router, NIXL between every worker rank) with prefill and decode pools of
different tensor-parallel sizes: the greedy text through the OpenAI API
equals ``tandem generate`` at TP=1 (the tiny model's byte tokenizer: one
token per character), the handoff really went P -> D (D read
KV), and both engines end idle and intact.

Each pairing is a whole service (engine and TP worker Ray actors, model
loads) on one local Ray shared by the module: tens of seconds each on a
loaded 2-core machine. The three pairings the design promises run here;
tests/e2e/test_pd_tensor_parallel.py runs them through engines and
tests/kvtransfer/test_tp_transfer.py checks their bytes and descriptors.
The (2, 2) service also loses a prefill worker (its Ray actor's process
SIGKILLed): Ray restarts the engine with a new epoch and the handoff works
again.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from tandem.cluster.cli.serve import ServiceThread
from tandem.cluster.cli.settings import serve_config
from tandem.wire.engine_protocol import SamplingParams
from tandem.workers.config import EngineConfig
from tandem.workers.engine.llm import LLM
from tests.cluster.service_helpers import client, wait_idle
from tests.cluster.test_service import ray_local  # noqa: F401 - the module's local Ray

pytestmark = [pytest.mark.slow, pytest.mark.shared_ray]

ENGINE = {"num_kv_blocks": 128, "max_num_seqs": 8, "max_model_len": 512, "torch_threads": 1}
PROMPTS = ["Tensor parallel prefill, then decode", "x" * 40 + " and a longer prompt of two blocks"]


@pytest.fixture(scope="module")
def reference():
    llm = LLM(EngineConfig.from_flat(model="tiny", num_kv_blocks=64))
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    return [r.text for r in llm.generate(PROMPTS, sp)]


PAIRINGS = [(2, 1), (1, 2), (2, 2)]


@pytest.mark.usefixtures("ray_local")
@pytest.mark.parametrize(("p_tp", "d_tp"), PAIRINGS)
def test_serve_across_tp_sizes_equals_generate(reference, p_tp, d_tp):
    config = serve_config(
        model="tiny",
        ray_dashboard=False,
        prefill=1,
        decode=1,
        kv_layout="head_major",
        **ENGINE,
        prefill_engine={"tensor_parallel_size": p_tp},
        decode_engine={"tensor_parallel_size": d_tp},
    )
    with ServiceThread(config) as svc:
        for prompt, expected in zip(PROMPTS, reference):
            r = client(svc).completions.create(
                model="tiny",
                prompt=prompt,
                max_tokens=8,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            assert r.usage.completion_tokens == 8
            assert r.choices[0].text == expected, (p_tp, d_tp, prompt)
        stats = wait_idle(svc)
        decode = [s for s in stats.values() if s.role == "decode"]
        assert decode and decode[0].kv_transfer.transfer_bytes_total > 0, stats
        if (p_tp, d_tp) == (2, 2):
            kill_a_worker_and_serve_again(svc, "prefill-0", PROMPTS[1], reference[1])


def kill_a_worker_and_serve_again(svc, engine_id: str, prompt: str, expected: str) -> None:
    """SIGKILL a TP worker of an idle engine: the engine fails as one unit (its
    idle loop notices), Ray restarts it with a new epoch, new workers and new
    rank side channels, the decode engines are told, and the handoff works again."""
    e = svc.service.backend.engines[engine_id]
    epoch, (worker_pid,) = e.state.epoch, e.state.info["tp_worker_pids"]
    os.kill(worker_pid, signal.SIGKILL)
    end = time.monotonic() + 120
    while e.state.epoch == epoch or not (e.state.info or {}).get("tp_worker_pids"):
        assert time.monotonic() < end, f"{engine_id} did not come back"
        time.sleep(0.1)
    assert e.state.info["tp_worker_pids"] != [worker_pid]
    before = wait_idle(svc)
    r = client(svc).completions.create(
        model="tiny", prompt=prompt, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.choices[0].text == expected
    after = wait_idle(svc)
    assert after["decode-0"].kv_transfer.transfer_bytes_total > (
        before["decode-0"].kv_transfer.transfer_bytes_total
    )  # read from the new incarnation
