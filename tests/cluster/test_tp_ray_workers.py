"""Under ``tandem serve`` a tensor-parallel engine's ranks 1..N-1 are Ray
actors, each in its own bundle of the engine's STRICT_PACK placement group
(workers/parallel/ray_workers.py, cluster/engines/placement.py): a TP=2
colocated engine on a local Ray runs rank 1 as an actor in bundle 1, its
greedy text equals TP=1 ``generate``, killing the worker actor restarts the
engine as one unit (new epoch, new worker actor, serves the same text), so
does stopping it (SIGSTOP: the engine fails after ``tp_step_timeout_s``, the
request in flight migrates to the new incarnation), and no worker actor
outlives the service."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from tandem.cluster.cli.serve import ServiceThread
from tandem.cluster.cli.settings import serve_config
from tandem.wire.engine_protocol import SamplingParams
from tandem.workers.config import EngineConfig
from tandem.workers.engine.llm import LLM
from tandem.workers.parallel.ray_workers import ACTOR_PREFIX
from tests.cluster.service_helpers import client, wait_idle
from tests.cluster.test_service import ray_local  # noqa: F401 - the module's local Ray
from tests.cluster.test_tp_placement import bundle_in_use

pytestmark = [pytest.mark.slow, pytest.mark.shared_ray]

ENGINE = {
    "num_kv_blocks": 64,
    "max_num_seqs": 4,
    "max_model_len": 256,
    "torch_threads": 1,
    "tp_step_timeout_s": 6.0,
}
PROMPT = "Rank one runs as a Ray actor"
RESTART_TIMEOUT_S = 120.0


def greedy(svc, timeout_s: float = 60.0) -> str:
    r = client(svc, timeout_s).completions.create(
        model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.usage.completion_tokens == 8
    return r.choices[0].text


def parent_pid(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def worker_actor_names() -> list[str]:
    import ray

    named = ray.util.list_named_actors(all_namespaces=True)
    return [a["name"] for a in named if a["name"].startswith(ACTOR_PREFIX)]


@pytest.mark.usefixtures("ray_local")
def test_tp_worker_is_a_ray_actor_in_bundle_one_and_fails_with_its_engine():
    import ray

    llm = LLM(EngineConfig.from_flat(model="tiny", num_kv_blocks=64))
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    (expected,) = [r.text for r in llm.generate([PROMPT], sp)]

    config = serve_config(
        model="tiny",
        ray_dashboard=False,
        colocated=1,
        migration_wait_s=RESTART_TIMEOUT_S,  # the request in flight waits for the restart
        **ENGINE,
        tensor_parallel_size=2,
    )
    with ServiceThread(config) as svc:
        e = svc.service.backend.engines["colocated-0"]
        (worker,) = e.state.info["tp_worker_actors"]
        pg_id = worker["placement_group_id"]
        assert pg_id == e.handle.placement_group.id.hex()  # the engine's group
        assert worker["bundle_index"] == 1
        assert bundle_in_use(pg_id, 1)  # Ray's own account: bundle 1 is taken
        assert parent_pid(worker["pid"]) != e.state.info["pid"]  # not its child process
        assert worker["pid"] == e.state.info["tp_worker_pids"][0]
        assert greedy(svc) == expected
        wait_idle(svc)

        epoch = e.state.epoch
        ray.kill(ray.get_actor(worker["name"], namespace=worker["namespace"]))
        end = time.monotonic() + RESTART_TIMEOUT_S
        while e.state.epoch == epoch or not (e.state.info or {}).get("tp_worker_actors"):
            assert time.monotonic() < end, "the engine did not come back"
            time.sleep(0.1)
        (new_worker,) = e.state.info["tp_worker_actors"]
        assert new_worker["name"] != worker["name"]
        assert new_worker["placement_group_id"] == pg_id
        wait_idle(svc)
        assert greedy(svc) == expected
        wait_idle(svc)  # idle and intact (check_integrity)

        # stopped, not dead: the request sent right after the stop makes rank 0's
        # collective time out; the engine fails, Ray restarts it, the request
        # migrates there and completes with the same text
        epoch = e.state.epoch
        migrations = sum(svc.service.backend.migrator.num_migrations.values())
        os.kill(new_worker["pid"], signal.SIGSTOP)
        texts: list[str] = []
        try:
            sender = threading.Thread(
                target=lambda: texts.append(greedy(svc, RESTART_TIMEOUT_S)), daemon=True
            )
            sender.start()
            sender.join(RESTART_TIMEOUT_S + 60)
        finally:
            try:
                os.kill(new_worker["pid"], signal.SIGCONT)
            except ProcessLookupError:  # the engine killed it, as it should
                pass
        assert texts == [expected]
        assert e.state.epoch != epoch
        assert sum(svc.service.backend.migrator.num_migrations.values()) == migrations + 1
        (new_worker,) = e.state.info["tp_worker_actors"]
        wait_idle(svc)
        end = time.monotonic() + 30  # the GCS drops dead names asynchronously
        while worker_actor_names() != [new_worker["name"]]:
            assert time.monotonic() < end, worker_actor_names()
            time.sleep(0.1)
    end = time.monotonic() + 30
    while worker_actor_names():
        assert time.monotonic() < end, f"worker actors leaked: {worker_actor_names()}"
        time.sleep(0.1)
