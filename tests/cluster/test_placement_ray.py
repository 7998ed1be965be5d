"""Per-pool Ray resources on a real multi-node local Ray: each pool's engines
land only on the nodes that advertise its resource (what the Helm chart's
worker groups do with ``rayStartParams.resources``)."""

from __future__ import annotations

import time

import pytest

from tandem.cluster.cli.main import build_parser
from tandem.cluster.cli.settings import pool_specs, resolve_config
from tandem.cluster.engines.pools import start_pools, stop_pools

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def two_groups():
    """Head (no pool resource) + a 'prefill' node + a 'decode' node, all on
    127.0.0.1; the two pool nodes advertise 2 logical GPUs (no device)."""
    import ray
    import ray._private.ray_constants as ray_constants
    from ray.cluster_utils import Cluster

    # Keep every address on loopback: without this Ray rewrites 127.0.0.1 in
    # the bootstrap address to the machine's outward interface.
    patch = pytest.MonkeyPatch()
    patch.setattr(ray_constants, "ENABLE_RAY_CLUSTER", False)
    patch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "include_dashboard": False, "node_ip_address": "127.0.0.1"},
    )
    nodes = {
        "prefill": cluster.add_node(
            num_cpus=1, num_gpus=2, resources={"tandem_prefill": 2}, node_ip_address="127.0.0.1"
        ),
        # 4 logical CPUs: every GPU engine's bundle takes one (fractional GPUs)
        "decode": cluster.add_node(
            num_cpus=4, num_gpus=2, resources={"tandem_decode": 4}, node_ip_address="127.0.0.1"
        ),
    }
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        cluster.wait_for_nodes(timeout=120)
        yield {role: node.node_id for role, node in nodes.items()}, cluster.head_node.node_id
    finally:
        ray.shutdown()
        cluster.shutdown()
        patch.undo()


def test_engines_land_on_their_pools_nodes(two_groups):
    import ray

    node_of_pool, head_id = two_groups
    args = build_parser().parse_args(
        [
            "serve", "--prefill", "2", "--decode", "1",
            "--prefill-ray-resources", '{"tandem_prefill": 1}',
            "--decode-ray-resources", '{"tandem_decode": 1}',
            "--num-kv-blocks", "32", "--max-model-len", "256", "--torch-threads", "1",
        ]
    )  # fmt: skip
    config = resolve_config(args)
    handles = start_pools(pool_specs(config), "tcp://127.0.0.1:1")
    try:
        refs = {h.engine_id: h.actor.ready.remote() for h in handles}
        deadline = time.monotonic() + 240
        infos = {}
        for engine_id, ref in refs.items():
            infos[engine_id] = ray.get(ref, timeout=max(1.0, deadline - time.monotonic()))
        placed = {eid: info["node_id"] for eid, info in infos.items()}
        assert placed == {
            "prefill-0": node_of_pool["prefill"],
            "prefill-1": node_of_pool["prefill"],
            "decode-0": node_of_pool["decode"],
        }
        assert head_id not in placed.values()
        checks = ray.get([h.actor.check_integrity.remote() for h in handles], timeout=60)
        assert all(checks)
    finally:
        stop_pools(handles)


def test_a_pool_whose_resource_no_node_has_is_not_placed(two_groups):
    """A third pool asking for an unknown resource stays pending (never lands
    on the wrong group)."""
    import ray

    args = build_parser().parse_args(
        ["serve", "--colocated", "1", "--colocated-ray-resources", '{"tandem_colocated": 1}']
    )
    handles = start_pools(pool_specs(resolve_config(args)), "tcp://127.0.0.1:1")
    try:
        ready, _ = ray.wait([handles[0].actor.ready.remote()], timeout=3)
        assert ready == []
    finally:
        stop_pools(handles, timeout_s=2)


def test_gpu_engines_placement_groups_land_on_their_pools_nodes(two_groups):
    """With GPUs per engine, each engine's placement group bundle carries its
    pool's resource too, so the bundle (and the engine in it) is reserved on
    the pool's node. Logical GPUs only: the engines themselves cannot start
    CUDA here, so the test checks where Ray reserved their bundles."""
    from ray.util.placement_group import placement_group_table

    node_of_pool, _ = two_groups
    args = build_parser().parse_args(
        [
            "serve", "--prefill", "1", "--decode", "1", "--max-restarts", "0",
            "--num-gpus-per-engine", "1", "--prefill-num-gpus-per-engine", "2",
            "--prefill-ray-resources", '{"tandem_prefill": 1}',
            "--decode-ray-resources", '{"tandem_decode": 1}',
        ]
    )  # fmt: skip
    handles = start_pools(pool_specs(resolve_config(args)), "tcp://127.0.0.1:1")
    try:
        for handle in handles:
            assert handle.placement_group.wait(timeout_seconds=60)
            table = placement_group_table(handle.placement_group)
            role = handle.role
            gpus = 2.0 if role == "prefill" else 1.0
            assert table["bundles"] == {0: {"GPU": gpus, "CPU": 1.0, f"tandem_{role}": 1.0}}
            assert table["bundles_to_node_id"] == {0: node_of_pool[role]}
    finally:
        stop_pools(handles, timeout_s=2)


def test_half_gpu_engines_are_packed_two_per_gpu(two_groups):
    """``--num-gpus-per-engine 0.5``: each engine's bundle reserves half a
    GPU, and Ray hands two such engines the same device. The engines cannot
    start CUDA here, so their bundles are checked, then probe actors placed
    exactly as ``start_pools`` places engines (``engine_actor_placement``)
    report the GPU ids Ray gives them."""
    import ray
    from ray.util.placement_group import (
        placement_group,
        placement_group_table,
        remove_placement_group,
    )
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from tandem.cluster.engines.placement import engine_actor_placement

    node_of_pool, _ = two_groups
    pinned = '{"tandem_decode": 1}'
    args = build_parser().parse_args(
        [
            "serve", "--model", "tiny", "--prefill", "1", "--decode", "1", "--max-restarts", "0",
            "--num-gpus-per-engine", "0.5",
            "--prefill-ray-resources", pinned, "--decode-ray-resources", pinned,
        ]
    )  # fmt: skip
    specs = pool_specs(resolve_config(args))
    assert [s.config.cache.gpu_memory_utilization for s in specs] == [0.45, 0.45]
    handles = start_pools(specs, "tcp://127.0.0.1:1")
    try:
        for handle in handles:
            assert handle.placement_group.wait(timeout_seconds=60)
            table = placement_group_table(handle.placement_group)
            assert table["bundles"] == {0: {"GPU": 0.5, "CPU": 1.0, "tandem_decode": 1.0}}
            assert table["bundles_to_node_id"] == {0: node_of_pool["decode"]}
    finally:
        stop_pools(handles, timeout_s=2)

    @ray.remote
    class Probe:
        def gpu_ids(self) -> list:
            return [str(i) for i in ray.get_gpu_ids()]

    groups, probes = [], []
    try:
        for _ in range(3):  # the decode node has 2 GPUs: 0.5 + 0.5 on one, the third on the other
            options, bundle = engine_actor_placement(0.5, {"tandem_decode": 1.0})
            pg = placement_group([bundle], strategy="STRICT_PACK")
            groups.append(pg)
            assert pg.wait(timeout_seconds=60)
            strategy = PlacementGroupSchedulingStrategy(pg)
            probes.append(Probe.options(**options, scheduling_strategy=strategy).remote())
        ids = ray.get([p.gpu_ids.remote() for p in probes], timeout=120)
        assert len(ids[0]) == 1 and ids[0] == ids[1], ids  # two engines, one GPU
        assert len(ids[2]) == 1 and ids[2] != ids[0], ids
    finally:
        for probe in probes:
            ray.kill(probe)
        for pg in groups:
            remove_placement_group(pg)
