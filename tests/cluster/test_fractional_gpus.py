"""Fractional GPUs per engine and per-pool memory shares (no Ray here; the
placement on a real local Ray is in test_placement_ray.py)."""

from __future__ import annotations

import pytest

from tandem.cluster.cli.main import build_parser
from tandem.cluster.cli.settings import pool_specs, resolve_config
from tandem.cluster.engines.placement import check_num_gpus, engine_actor_placement


def specs_for(argv: list[str]) -> dict:
    args = build_parser().parse_args(["serve", *argv])
    return {s.role: s for s in pool_specs(resolve_config(args))}


def test_half_a_gpu_each_packs_prefill_and_decode_with_default_memory_shares():
    specs = specs_for(["--prefill", "1", "--decode", "1", "--num-gpus-per-engine", "0.5"])
    for role in ("prefill", "decode"):
        assert specs[role].num_gpus == 0.5
        assert specs[role].config.cache.gpu_memory_utilization == pytest.approx(0.45)
    options, bundle = engine_actor_placement(0.5, {})
    assert options == {"num_cpus": 0, "num_gpus": 0.5}
    assert bundle == {"GPU": 0.5, "CPU": 1}


def test_per_pool_fractions_and_memory_utilizations():
    specs = specs_for(
        [
            "--prefill-num-gpus-per-engine", "0.25", "--decode-num-gpus-per-engine", "0.75",
            "--prefill-gpu-memory-utilization", "0.2",
            "--decode-gpu-memory-utilization", "0.7",
        ]
    )  # fmt: skip
    assert (specs["prefill"].num_gpus, specs["decode"].num_gpus) == (0.25, 0.75)
    assert specs["prefill"].config.cache.gpu_memory_utilization == 0.2
    assert specs["decode"].config.cache.gpu_memory_utilization == 0.7


def test_whole_gpus_stay_integers_and_keep_the_default_utilization():
    specs = specs_for(["--num-gpus-per-engine", "1", "--prefill-num-gpus-per-engine", "2"])
    assert (specs["prefill"].num_gpus, specs["decode"].num_gpus) == (2, 1)
    assert isinstance(specs["prefill"].num_gpus, int)
    assert specs["decode"].config.cache.gpu_memory_utilization == 0.9
    assert engine_actor_placement(0, {"tandem_decode": 1.0}) == (
        {"num_cpus": 0, "num_gpus": 0, "resources": {"tandem_decode": 1.0}},
        None,
    )


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--num-gpus-per-engine", "1.5"], "--num-gpus-per-engine"),
        (["--num-gpus-per-engine", "-0.5"], "--num-gpus-per-engine"),
        (["--decode-num-gpus-per-engine", "2.5"], "--decode-num-gpus-per-engine"),
        (["--prefill-num-gpus-per-engine", "nan"], "--prefill-num-gpus-per-engine"),
        (
            ["--num-gpus-per-engine", "0.5", "--decode-gpu-memory-utilization", "0.8"],
            "--decode-gpu-memory-utilization",
        ),
        (
            ["--num-gpus-per-engine", "0.5", "--gpu-memory-utilization", "0.6"],
            "--gpu-memory-utilization",
        ),
        (["--prefill-gpu-memory-utilization", "1.5"], "gpu_memory_utilization"),
    ],
)
def test_bad_values_are_refused_naming_the_flag(argv, flag):
    with pytest.raises(ValueError, match=flag):
        specs_for(argv)


@pytest.mark.parametrize("value, expected", [(0, 0), (0.5, 0.5), (1.0, 1), (4.0, 4), (1, 1)])
def test_check_num_gpus_accepts(value, expected):
    result = check_num_gpus(value, "num_gpus_per_engine")
    assert result == expected and type(result) is type(expected)
