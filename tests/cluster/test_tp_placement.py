"""Bundle shapes of an engine's placement group per tensor-parallel size
(cluster/engines/placement.py): one bundle per rank, resources on bundle 0."""

from __future__ import annotations

import time

import pytest

from tandem.cluster.engines.placement import (
    CPU_RANK_SHARE,
    check_pool_parallel,
    engine_group_placement,
)
from tandem.workers.config import EngineConfig


def test_gpu_engine_gets_one_bundle_per_rank():
    options, bundles = engine_group_placement(2, {"tandem_prefill": 1.0}, 2)
    assert bundles == [{"GPU": 1, "CPU": 1, "tandem_prefill": 1.0}, {"GPU": 1, "CPU": 1}]
    assert options["num_gpus"] == 1  # the engine actor holds bundle 0's GPU only
    assert options["resources"] == {"tandem_prefill": 1.0}
    _, bundles = engine_group_placement(4, {}, 2)
    assert bundles == [{"GPU": 2, "CPU": 1}, {"GPU": 2, "CPU": 1}]


def test_tp1_keeps_one_bundle_and_cpu_tp1_none():
    assert engine_group_placement(1, {}, 1)[1] == [{"GPU": 1, "CPU": 1}]
    options, bundles = engine_group_placement(0, {}, 1)
    assert bundles is None and options["num_gpus"] == 0


def test_cpu_engine_with_tp_gets_token_cpu_bundles():
    options, bundles = engine_group_placement(0, {"tandem_decode": 1.0}, 3)
    assert bundles == [
        {"CPU": CPU_RANK_SHARE, "tandem_decode": 1.0},
        {"CPU": CPU_RANK_SHARE},
        {"CPU": CPU_RANK_SHARE},
    ]
    assert options["num_cpus"] == 0 and options["num_gpus"] == 0


def test_gpus_that_do_not_split_are_refused():
    with pytest.raises(ValueError, match="num_gpus_per_engine"):
        engine_group_placement(3, {}, 2)
    with pytest.raises(ValueError, match="equal whole GPUs"):
        engine_group_placement(0.5, {}, 2)  # NCCL: one GPU per rank
    with pytest.raises(ValueError, match="prefill_num_gpus_per_engine"):
        check_pool_parallel("prefill", EngineConfig.from_flat(tensor_parallel_size=2), num_gpus=3)
    check_pool_parallel("prefill", EngineConfig.from_flat(tensor_parallel_size=2), num_gpus=4)


def bundle_in_use(pg_id: str, index: int, wait_s: float = 30.0) -> bool:
    """Whether bundle ``index``'s CPU share is taken (Ray drops a resource it
    has none left of from ``available_resources``; reports lag: poll)."""
    import ray

    key = f"CPU_group_{index}_{pg_id}"
    end = time.monotonic() + wait_s
    while True:
        if key not in ray.available_resources():
            return True
        if time.monotonic() >= end:
            return False
        time.sleep(0.1)


@pytest.mark.slow
def test_strict_pack_group_places_each_rank_in_its_bundle(tmp_path):
    """A real local Ray: the group of a CPU TP=3 engine is STRICT_PACK with 3
    bundles, and an actor asked into bundle 2 holds bundle 2's resources."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    ray.init(include_dashboard=False, num_cpus=1, log_to_driver=False)
    try:
        _, bundles = engine_group_placement(0, {}, 3)
        pg = placement_group(bundles, strategy="STRICT_PACK")
        ray.get(pg.ready(), timeout=60)
        assert pg.bundle_specs == bundles
        assert ray.util.placement_group_table(pg)["strategy"] == "STRICT_PACK"

        @ray.remote(num_cpus=CPU_RANK_SHARE)
        class Rank:
            def pg(self) -> str | None:
                return ray.get_runtime_context().get_placement_group_id()

        strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=2)
        rank = Rank.options(scheduling_strategy=strategy).remote()
        assert ray.get(rank.pg.remote(), timeout=60) == pg.id.hex()
        # bundle 2's whole CPU share is the actor's; bundles 0 and 1 stay free
        assert bundle_in_use(pg.id.hex(), 2)
        assert not bundle_in_use(pg.id.hex(), 1, wait_s=0)
        ray.kill(rank)
        remove_placement_group(pg)
    finally:
        ray.shutdown()
