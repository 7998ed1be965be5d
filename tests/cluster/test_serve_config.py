"""`tandem serve` settings: defaults < YAML < command line, per-pool engine flags."""

import pytest

from tandem.cluster.cli.main import build_parser
from tandem.cluster.cli.settings import pool_specs, resolve_config


def parse(argv):
    return build_parser().parse_args(["serve", *argv])


def test_defaults_one_prefill_one_decode_smollm2():
    config = resolve_config(parse([]))
    specs = pool_specs(config)
    assert [(s.role, s.num_engines) for s in specs] == [("prefill", 1), ("decode", 1)]
    assert all(
        s.config.model.name == "smollm2" and s.config.kv_transfer.connector == "nixl" for s in specs
    )
    assert config.server.port == 8000 and config.server.host == "127.0.0.1"


def test_yaml_then_cli_then_per_pool(tmp_path):
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(
        "prefill: 2\ndecode: 3\nport: 9000\nblock_size: 32\nmax_num_seqs: 16\n"
        "decode_engine: {max_num_seqs: 200}\n"
    )
    args = parse(
        [
            "--config",
            str(cfg),
            "--port",
            "9100",
            "--prefill-max-num-batched-tokens",
            "8192",
            "--no-prefix-caching",
        ]
    )
    config = resolve_config(args)
    specs = {s.role: s for s in pool_specs(config)}
    assert config.server.port == 9100  # CLI wins over YAML
    assert specs["prefill"].num_engines == 2 and specs["decode"].num_engines == 3
    assert specs["prefill"].config.scheduler.max_num_batched_tokens == 8192
    assert specs["decode"].config.scheduler.max_num_batched_tokens == 2048  # per pool only
    assert (
        specs["decode"].config.scheduler.max_num_seqs == 200
        and specs["prefill"].config.scheduler.max_num_seqs == 16
    )
    assert all(s.config.cache.block_size == 32 for s in specs.values())
    assert not any(s.config.cache.enable_prefix_caching for s in specs.values())


def test_colocated_replaces_pools():
    specs = pool_specs(resolve_config(parse(["--colocated", "2"])))
    assert [(s.role, s.num_engines, s.config.kv_transfer.connector) for s in specs] == [
        ("colocated", 2, None)
    ]


def test_bad_settings_are_clear_errors(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("prefil: 2\n")
    with pytest.raises(ValueError, match="prefil"):
        resolve_config(parse(["--config", str(bad)]))
    with pytest.raises(ValueError, match="decode"):
        resolve_config(parse(["--decode", "0"]))
    with pytest.raises(ValueError, match="block_size"):
        resolve_config(parse(["--block-size", "0"]))


def test_prefix_caching_hash_algo_per_pool_and_named_when_bad():
    config = resolve_config(parse(["--decode-prefix-caching-hash-algo", "xxhash128"]))
    specs = {s.role: s for s in pool_specs(config)}
    assert specs["prefill"].config.cache.prefix_caching_hash_algo == "sha256"  # the default
    assert specs["decode"].config.cache.prefix_caching_hash_algo == "xxhash128"
    with pytest.raises(ValueError, match="prefix_caching_hash_algo"):
        resolve_config(parse(["--prefix-caching-hash-algo", "md5"]))


def test_scheduling_flags_per_pool_and_named_when_bad():
    args = parse(
        [
            "--scheduling-policy",
            "priority",
            "--prefill-scheduling-policy",
            "prefill-first",
            "--kv-admission-margin",
            "0.1",
            "--long-prefill-token-threshold",
            "256",
            "--prefill-max-num-partial-prefills",
            "4",
            "--prefill-max-long-partial-prefills",
            "1",
        ]
    )
    specs = {s.role: s for s in pool_specs(resolve_config(args))}
    p, d = specs["prefill"].config.scheduler, specs["decode"].config.scheduler
    assert (p.policy, d.policy) == ("prefill-first", "priority")
    assert p.kv_admission_margin == d.kv_admission_margin == 0.1
    assert (p.max_num_partial_prefills, p.max_long_partial_prefills) == (4, 1)
    assert (d.max_num_partial_prefills, d.max_long_partial_prefills) == (0, 0)
    for argv, field in (
        (["--scheduling-policy", "lifo"], "policy"),
        (["--decode-kv-admission-margin", "1.5"], "kv_admission_margin"),
        (["--max-long-partial-prefills", "1"], "long_prefill_token_threshold"),
    ):
        with pytest.raises(ValueError, match=field):
            resolve_config(parse(argv))
