"""`tandem serve --check-config` and the per-pool placement flags."""

import json
import subprocess
import sys

import pytest

from tandem.cluster.cli.main import build_parser
from tandem.cluster.cli.settings import pool_specs, resolve_config
from tandem.cluster.engines.placement import parse_ray_resources


def run_check(argv, tmp_path=None):
    """The real CLI in a subprocess: (exit code, stdout, stderr)."""
    proc = subprocess.run(
        [sys.executable, "-m", "tandem.cluster", "serve", *argv, "--check-config"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    return proc.returncode, proc.stdout, proc.stderr


def parse(argv):
    return build_parser().parse_args(["serve", *argv])


def test_per_pool_resources_and_gpus_reach_pool_specs():
    args = parse(
        [
            "--prefill", "2", "--decode", "4",
            "--num-gpus-per-engine", "1",
            "--prefill-num-gpus-per-engine", "2",
            "--prefill-ray-resources", '{"tandem_prefill": 1}',
            "--decode-ray-resources", '{"tandem_decode": 0.5}',
        ]
    )  # fmt: skip
    specs = {s.role: s for s in pool_specs(resolve_config(args))}
    assert specs["prefill"].num_gpus == 2 and specs["decode"].num_gpus == 1
    assert specs["prefill"].resources == {"tandem_prefill": 1.0}
    assert specs["decode"].resources == {"tandem_decode": 0.5}


def test_yaml_accepts_mappings_for_resources(tmp_path):
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("colocated: 2\ncolocated_ray_resources: {tandem_colocated: 1}\n")
    config = resolve_config(parse(["--config", str(cfg)]))
    (spec,) = pool_specs(config)
    assert spec.role == "colocated" and spec.resources == {"tandem_colocated": 1.0}


@pytest.mark.parametrize(
    "value, message",
    [
        ("{not json", "not valid JSON"),
        ("[1]", "expected a JSON object"),
        ('{"GPU": 1}', "set by Ray itself"),
        ('{"x": -1}', ">= 0"),
        ('{"x": "one"}', "must be a number"),
    ],
)
def test_bad_ray_resources_name_the_field(value, message):
    with pytest.raises(ValueError, match=message) as info:
        parse_ray_resources(value, "decode_ray_resources")
    assert "decode_ray_resources" in str(info.value)


def test_check_config_prints_resolved_config_and_hides_the_key(tmp_path):
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(
        "prefill: 2\ndecode: 3\nkv_lease_s: 30\nprefill_engine: {max_num_batched_tokens: 8192}\n"
    )
    code, out, err = run_check(
        ["--config", str(cfg), "--api-key", "sekret", "--decode-ray-resources", '{"d": 1}']
    )
    assert code == 0, err
    assert "sekret" not in out
    config = json.loads(out)
    assert config["serve"]["api_key"] == "<set>"
    pools = {p["role"]: p for p in config["pools"]}
    assert (pools["prefill"]["num_engines"], pools["decode"]["num_engines"]) == (2, 3)
    assert pools["prefill"]["engine"]["max_num_batched_tokens"] == 8192
    assert pools["decode"]["engine"]["max_num_batched_tokens"] == 2048
    assert pools["decode"]["ray_resources"] == {"d": 1.0}
    assert pools["prefill"]["engine"]["kv_lease_s"] == 30


@pytest.mark.parametrize(
    "yaml_text, argv, message",
    [
        ("prefil: 2\n", [], "prefil"),
        ("decode_engine: {max_num_seq: 3}\n", [], "max_num_seq"),
        ("", ["--block-size", "0"], "block_size"),
        ("", ["--prefill-ray-resources", "{oops"], "prefill_ray_resources"),
        ("", ["--decode-num-gpus-per-engine", "-1"], "decode_num_gpus_per_engine"),
        ("", ["--decode", "0"], "--decode"),
    ],
)
def test_check_config_rejects_bad_config_with_exit_2(tmp_path, yaml_text, argv, message):
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(yaml_text)
    code, out, err = run_check(["--config", str(cfg), *argv])
    assert code == 2 and out == ""
    assert err.startswith("error: ") and message in err
    assert "Traceback" not in err


def test_serve_config_from_keys_makes_pool_specs():
    """Tests and benchmarks build the config from flat keys (serve_config):
    the per-pool placement falls back to the global one."""
    from tandem.cluster.cli.settings import serve_config

    specs = pool_specs(serve_config(model="tiny", num_gpus_per_engine=0))
    assert [(s.role, s.num_gpus, s.resources) for s in specs] == [
        ("prefill", 0, {}),
        ("decode", 0, {}),
    ]
