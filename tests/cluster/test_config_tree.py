"""The serve configuration tree (cluster/cli/config/): every flag of the old
hand-written CLI still parses onto the right field, hidden per-pool aliases
warn, YAML maps onto the same tree, help is grouped by section."""

from __future__ import annotations

import argparse
import json
import logging

import pytest
import yaml

from tandem.cluster.cli.check_config import resolved_config
from tandem.cluster.cli.config.keys import all_settings, by_key, defaults, flatten, get
from tandem.cluster.cli.main import build_parser
from tandem.cluster.cli.settings import ServeConfig, pool_specs, resolve_config, serve_config
from tandem.cluster.engines.placement import ROLES

ROLE_NAMES = ROLES  # prefill, decode, colocated


def parse(argv: list[str]) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *argv])


def serve_parser() -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["serve"]


# ---- every flag of the old CLI (2bba272: workers/config.py _FLAGS, _BOOL_OFF_FLAGS,
# _BOOL_ON_FLAGS x {"", prefill-, decode-, colocated-}, and cluster/cli/serve.py)

# old engine flag -> (its arguments, the EngineConfig field, the value it sets)
OLD_ENGINE_FLAGS = {
    "--dtype": (["bfloat16"], "dtype", "bfloat16"),
    "--device": (["cuda"], "device", "cuda"),
    "--block-size": (["32"], "block_size", 32),
    "--max-num-seqs": (["7"], "max_num_seqs", 7),
    "--max-num-batched-tokens": (["4096"], "max_num_batched_tokens", 4096),
    "--max-model-len": (["256"], "max_model_len", 256),
    "--num-kv-blocks": (["64"], "num_kv_blocks", 64),
    "--kv-cache-memory": (["1000000"], "kv_cache_memory", 1000000),
    "--gpu-memory-utilization": (["0.5"], "gpu_memory_utilization", 0.5),
    "--long-prefill-token-threshold": (["64"], "long_prefill_token_threshold", 64),
    "--scheduling-policy": (["priority"], "policy", "priority"),
    "--kv-admission-margin": (["0.1"], "kv_admission_margin", 0.1),
    "--max-num-partial-prefills": (["2"], "max_num_partial_prefills", 2),
    "--max-long-partial-prefills": (
        ["1", "--long-prefill-token-threshold", "64"],
        "max_long_partial_prefills",
        1,
    ),
    "--prefix-caching-hash-algo": (["xxhash128"], "prefix_caching_hash_algo", "xxhash128"),
    "--tensor-parallel-size": (["2"], "tensor_parallel_size", 2),
    "-tp": (["2"], "tensor_parallel_size", 2),
    "--tp-step-timeout-s": (["5"], "tp_step_timeout_s", 5.0),
    "--torch-threads": (["2"], "torch_threads", 2),
    "--dense-decode-bytes": (["0"], "dense_decode_bytes", 0),
    "--kv-layout": (["head_major"], "kv_layout", "head_major"),
    "--cuda-graph-sizes": (["1,2,4"], "cuda_graph_sizes", [1, 2, 4]),
    "--prefill-attention": (["sdpa"], "prefill_attention", "sdpa"),
    "--cuda-graph-mode": (["piecewise"], "cuda_graph_mode", "piecewise"),
    "--piecewise-graph-sizes": (["8,16"], "piecewise_graph_sizes", [8, 16]),
    "--compile-model": (["on"], "compile_model", "on"),
    "--kv-transport-probe": (["on"], "kv_transport_probe", "on"),
    "--output-hwm-messages": (["10"], "output_hwm_messages", 10),
    "--output-backlog-messages": (["5"], "output_backlog_messages", 5),
    "--output-stall-timeout-s": (["9"], "output_stall_timeout_s", 9.0),
    "--no-prefix-caching": ([], "enable_prefix_caching", False),
    "--no-chunked-prefill": ([], "enable_chunked_prefill", False),
    "--no-async-scheduling": ([], "async_scheduling", False),
    "--enforce-eager": ([], "enforce_eager", True),
    "--async-scheduling": ([], "async_scheduling", True),
}
_LIFETIME = ["--address", "a:1", "--cluster-secret-file", "/etc/tandem/secret"]
# old serve flag -> (its arguments, the flat key it sets, the value it sets)
OLD_SERVE_FLAGS = {
    "--model": (["tiny"], "model", "tiny"),
    "--prefill": (["2"], "prefill", 2),
    "--decode": (["3"], "decode", 3),
    "--colocated": (["2"], "colocated", 2),
    "--host": (["0.0.0.0"], "host", "0.0.0.0"),
    "--port": (["9001"], "port", 9001),
    "--api-key": (["k"], "api_key", "<set>"),
    "--address": (["a:1"], "address", "a:1"),
    "--disagg-min-tokens": (["5"], "disagg_min_tokens", 5),
    "--max-restarts": (["1"], "max_restarts", 1),
    "--num-gpus-per-engine": (["0.5"], "num_gpus_per_engine", 0.5),
    "--kv-lease-s": (["5"], "kv_lease_s", 5.0),
    "--load-failure-policy": (["fail"], "load_failure_policy", "fail"),
    "--max-request-body-mb": (["2"], "max_request_body_mb", 2.0),
    "--max-num-requests": (["4"], "max_num_requests", 4),
    "--request-timeout-s": (["5"], "request_timeout_s", 5.0),
    "--engine-dead-after-s": (["9"], "engine_dead_after_s", 9.0),
    "--max-queued-outputs": (["7"], "max_queued_outputs", 7),
    "--tokenizer-workers": (["3"], "tokenizer_workers", 3),
    "--max-logprobs": (["5"], "max_logprobs", 5),
    "--cluster-secret-file": (["/s"], "cluster_secret_file", "/s"),
    "--no-internal-auth": ([], "internal_auth", False),
    "--served-model-name": (["a", "b"], "served_model_name", ["a", "b"]),
    "--chat-template": (["t.jinja"], "chat_template", "t.jinja"),
    "--generation-config": (["vllm"], "generation_config", "vllm"),
    "--router": (["kv-aware"], "router", "kv-aware"),
    "--router-hit-weight": (["2"], "router_hit_weight", 2.0),
    "--router-load-weight": (["3"], "router_load_weight", 3.0),
    "--router-prefill-queue-weight": (["4"], "router_prefill_queue_weight", 4.0),
    "--router-busy-threshold": (["0.8"], "router_busy_threshold", 0.8),
    "--log-format": (["json"], "log_format", "json"),
    "--otlp-traces-endpoint": (["http://otel:4318"], "otlp_traces_endpoint", "http://otel:4318"),
    "--ray-namespace": (["ns"], "ray_namespace", "ns"),
    "--no-migration": ([], "migration", False),
    "--max-migrations": (["1"], "max_migrations", 1),
    "--migration-handoff-min-tokens": (["9"], "migration_handoff_min_tokens", 9),
    "--migration-wait-s": (["4"], "migration_wait_s", 4.0),
    "--admin-api-key": (["k"], "admin_api_key", "<set>"),
    "--detach-engines": (_LIFETIME, "detach_engines", True),
    "--attach": (_LIFETIME, "attach", True),
}
for _role in ROLE_NAMES:
    OLD_SERVE_FLAGS[f"--{_role}-ray-resources"] = (
        ['{"r": 1}'],
        f"{_role}_ray_resources",
        {"r": 1.0},
    )
    OLD_SERVE_FLAGS[f"--{_role}-num-gpus-per-engine"] = (
        ["1"],
        f"{_role}_num_gpus_per_engine",
        1,
    )
NOT_SETTINGS = ("--config", "--check-config")  # a file to read; an action


def test_the_tables_hold_all_184_old_options():
    per_pool = [
        f"--{r}-{flag[2:]}" for r in ROLE_NAMES for flag in OLD_ENGINE_FLAGS if flag != "-tp"
    ]
    old = set(OLD_ENGINE_FLAGS) - {"-tp"} | set(OLD_SERVE_FLAGS) | set(NOT_SETTINGS) | set(per_pool)
    assert len(old) == 184  # `tandem serve --help` at 2bba272 (benchmarks/structure.py)


@pytest.mark.parametrize("flag", sorted(OLD_SERVE_FLAGS))
def test_every_old_serve_flag_sets_its_key(flag, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    args, key, value = OLD_SERVE_FLAGS[flag]
    config = resolve_config(parse([flag, *args]))
    assert flatten(config)[key] == value
    assert flatten(config)[key] != flatten(defaults())[key]


@pytest.mark.parametrize("flag", sorted(OLD_ENGINE_FLAGS))
def test_every_old_engine_flag_sets_every_pool(flag):
    args, field, value = OLD_ENGINE_FLAGS[flag]
    config = resolve_config(parse([flag, *args]))
    for role in ROLE_NAMES:
        assert config.pool_engine(role).get(field) == value, role
        assert defaults().pool_engine(role).get(field) != value


@pytest.mark.parametrize("role", ROLE_NAMES)
@pytest.mark.parametrize("flag", sorted(set(OLD_ENGINE_FLAGS) - {"-tp"}))
def test_every_old_per_pool_flag_sets_only_its_pool(flag, role, caplog):
    args, field, value = OLD_ENGINE_FLAGS[flag]
    extra = args[1:]  # a flag this one needs (for all pools)
    config = resolve_config(parse([f"--{role}-{flag[2:]}", *args[:1], *extra]))
    assert config.pool_engine(role).get(field) == value
    for other in set(ROLE_NAMES) - {role}:
        expected = resolve_config(parse(extra)).pool_engine(other).get(field)
        assert config.pool_engine(other).get(field) == expected


# ---- hidden aliases -----------------------------------------------------------------


@pytest.mark.parametrize("field, flag, value", [("device", "--decode-device", "cuda"),
                                                ("block_size", "--prefill-block-size", "32"),
                                                ("dtype", "--colocated-dtype", "float16")])  # fmt: skip
def test_hidden_pool_aliases_warn_naming_the_flag_and_still_apply(field, flag, value, caplog):
    help_text = serve_parser().format_help()
    assert flag not in help_text and f"--{field.replace('_', '-')} " in help_text
    role = flag[2:].split("-")[0]
    with caplog.at_level(logging.WARNING, logger="tandem.config"):
        config = resolve_config(parse([flag, value]))
    (record,) = caplog.records
    assert flag in record.getMessage()
    assert f"use --{field.replace('_', '-')}" in record.getMessage()
    assert str(config.pool_engine(role).get(field)) == value  # applied as before
    other = next(r for r in ROLE_NAMES if r != role)
    assert config.pool_engine(other).get(field) == defaults().engine.get(field)


def test_yaml_pool_keys_of_settings_one_for_every_pool_warn_too(tmp_path, caplog):
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("decode_engine: {device: cuda, max_num_seqs: 9}\n")
    with caplog.at_level(logging.WARNING, logger="tandem.config"):
        config = resolve_config(parse(["--config", str(cfg)]))
    assert [r.getMessage().split(":")[0] for r in caplog.records] == ["decode_engine.device"]
    assert "use the top-level key device" in caplog.records[0].getMessage()
    assert config.pool_engine("decode").model.device == "cuda"
    assert config.pool_engine("decode").scheduler.max_num_seqs == 9
    assert (
        config.pool_engine("prefill").scheduler.max_num_seqs
        == defaults().engine.scheduler.max_num_seqs
    )


# ---- YAML onto the tree -------------------------------------------------------------


@pytest.mark.parametrize(
    "text, name",
    [
        ("prefil: 2\n", "prefil"),
        ("routing: {busy: 1}\n", "routing.busy"),
        ("pools: {decode: {num_engine: 2}}\n", "pools.decode.num_engine"),
        ("decode_engine: {max_num_seq: 3}\n", "max_num_seq"),
        ("role: decode\n", "role"),
    ],
)
def test_unknown_yaml_keys_are_errors_naming_them(tmp_path, text, name):
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(text)
    with pytest.raises(ValueError, match="unknown keys") as info:
        resolve_config(parse(["--config", str(cfg)]))
    assert name in str(info.value)


def test_yaml_values_of_the_wrong_type_name_the_key(tmp_path):
    cfg = tmp_path / "serve.yaml"
    for text, name in (
        ("max_num_seqs: many\n", "max_num_seqs"),
        ("decode_engine: {block_size: big}\n", "decode_engine.block_size"),
        ("migration: maybe\n", "migration"),
        ("server: 8000\n", "server"),
    ):
        cfg.write_text(text)
        with pytest.raises(ValueError, match=name):
            resolve_config(parse(["--config", str(cfg)]))


def test_an_empty_pool_mapping_is_no_setting(tmp_path):
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("decode_engine:\nprefill: 1\n")
    assert resolve_config(parse(["--config", str(cfg)])) == defaults()


def test_flat_and_section_yaml_give_the_same_tree(tmp_path):
    flat, nested = tmp_path / "flat.yaml", tmp_path / "nested.yaml"
    flat.write_text(
        "prefill: 2\nrouter_busy_threshold: 0.8\nmax_num_seqs: 64\nmigration: false\n"
        "decode_engine: {max_num_seqs: 256}\nengine_call_timeout_s: 2\n"
    )
    nested.write_text(
        "pools: {prefill: {num_engines: 2}, decode: {engine: {max_num_seqs: 256}}}\n"
        "routing: {busy_threshold: 0.8}\nengine: {max_num_seqs: 64}\n"
        "migration: {enabled: false}\nhealth: {engine_call_timeout_s: 2}\n"
    )
    a = resolve_config(parse(["--config", str(flat)]))
    b = resolve_config(parse(["--config", str(nested)]))
    assert a == b
    # the engine by its sections, as --check-config prints it
    nested.write_text(nested.read_text().replace(
        "engine: {max_num_seqs: 64}", "engine: {scheduler: {max_num_seqs: 64}}"
    ))  # fmt: skip
    assert resolve_config(parse(["--config", str(nested)])) == a
    nested.write_text("engine: {scheduler: {max_num_sequences: 64}}\n")
    with pytest.raises(ValueError, match="engine.scheduler.max_num_sequences"):
        resolve_config(parse(["--config", str(nested)]))
    assert (
        a.pool_engine("decode").scheduler.max_num_seqs == 256
        and a.health.engine_call_timeout_s == 2
    )


def test_cli_wins_over_yaml_over_defaults(tmp_path):
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("port: 9000\nmax_num_seqs: 16\nrouter: round-robin\n")
    config = resolve_config(parse(["--config", str(cfg), "--port", "9100"]))
    assert config.server.port == 9100  # CLI over YAML
    assert config.engine.scheduler.max_num_seqs == 16 and config.routing.router == "round-robin"
    assert config.server.host == defaults().server.host  # neither: the default


def test_check_config_prints_a_tree_that_is_a_valid_config(tmp_path):
    config = resolve_config(
        parse(["--prefill", "2", "--decode-max-num-seqs", "9", "--no-migration"])
    )
    printed = json.loads(json.dumps(resolved_config(config)))
    cfg = tmp_path / "tree.yaml"
    cfg.write_text(yaml.safe_dump(printed["config"]))
    assert resolve_config(parse(["--config", str(cfg)])) == config
    cfg.write_text(yaml.safe_dump(printed["serve"]))  # the flat keys too
    assert resolve_config(parse(["--config", str(cfg)])) == config


# ---- per-pool overrides -------------------------------------------------------------


def test_per_pool_override_reaches_only_its_pool():
    config = serve_config(
        max_num_seqs=16, decode_engine={"max_num_seqs": 200, "enforce_eager": True}
    )
    specs = {s.role: s.config for s in pool_specs(config)}
    assert (specs["prefill"].scheduler.max_num_seqs, specs["decode"].scheduler.max_num_seqs) == (
        16,
        200,
    )
    assert specs["decode"].graphs.enforce_eager and not specs["prefill"].graphs.enforce_eager
    assert config.pool_engine("colocated").scheduler.max_num_seqs == 16
    cli = resolve_config(parse(["--max-num-seqs", "16", "--decode-max-num-seqs", "200"]))
    assert [s.config.scheduler.max_num_seqs for s in pool_specs(cli)] == [16, 200]


# ---- the generated CLI --------------------------------------------------------------


def test_help_is_grouped_by_section():
    groups = {g.title: g for g in serve_parser()._action_groups}
    for title in (
        "Gateway limits",
        "Routing",
        "Decode migration",
        "Engine health",
        "Security",
        "Logging and tracing",
        "API surface",
        "Pools and placement",
        "Engine: scheduling",
        "Per-pool engine settings",
    ):
        assert title in groups, title

    def flags(title):
        return {o for a in groups[title]._group_actions for o in a.option_strings}

    assert {"--max-num-requests", "--max-queued-outputs"} <= flags("Gateway limits")
    assert {"--engine-dead-after-s", "--engine-call-timeout-s"} <= flags("Engine health")
    assert "--router-busy-threshold" in flags("Routing")
    assert {"--max-num-seqs", "--scheduling-policy"} <= flags("Engine: scheduling")
    assert "--decode-max-num-seqs" in flags("Per-pool engine settings")
    text = serve_parser().format_help()
    assert text.index("Gateway limits:") < text.index("--max-num-requests") < text.index("Routing:")


def test_pool_flags_only_for_settings_that_mean_something_per_pool():
    shown = {
        o for a in serve_parser()._actions if a.help != argparse.SUPPRESS for o in a.option_strings
    }
    for s in all_settings():
        if s.path[0] != "engine" or s.meta.yaml_only:
            continue
        flag = "--decode-" + s.key.replace("_", "-")
        if s.key == "policy":
            flag = "--decode-scheduling-policy"
        elif s.key.startswith("enable_"):
            flag = "--decode-no-" + s.key.removeprefix("enable_").replace("_", "-")
        assert (flag in shown) == s.per_pool, flag


def test_every_setting_is_a_flag_and_a_yaml_key_with_its_default_once():
    parser = serve_parser()
    dests = {a.dest for a in parser._actions}
    for s in all_settings():
        assert s.meta.help, s.key
        assert s.key in by_key()
        if not s.meta.yaml_only:
            assert s.key in dests, s.key  # a flag
    for a in parser._actions:  # no default in the parser: the fields hold them
        if a.dest not in ("help", "check_config"):
            assert a.default is None, a.dest
    config = serve_config(engine_call_timeout_s=2.5)  # was YAML-only before the tree
    assert config.health.engine_call_timeout_s == 2.5
    assert resolve_config(parse(["--engine-call-timeout-s", "2.5"])) == config


def test_defaults_are_the_fields_defaults():
    config = ServeConfig()
    assert resolve_config(parse([])) == config
    assert get(config, ("routing", "busy_threshold")) == 0.5
    assert config.health.engine_dead_after_s == 30.0
    assert config.limits.max_queued_outputs == 512


def test_colocated_engines_with_host_tiers_get_nixl_to_lend_to_each_other():
    # more than one colocated engine with a host KV tier: NIXL, so a tier prefix is lent
    assert (
        serve_config(colocated=2, kv_offloading_size=1.0)
        .pool_engine("colocated")
        .kv_transfer.connector
        == "nixl"
    )
    per_pool = serve_config(colocated=2, colocated_engine={"kv_offloading_size": 1.0})
    assert per_pool.pool_engine("colocated").kv_transfer.connector == "nixl"
    # one engine, or no tiers: nobody to lend to, nothing to lend
    assert (
        serve_config(colocated=1, kv_offloading_size=1.0)
        .pool_engine("colocated")
        .kv_transfer.connector
        is None
    )
    assert serve_config(colocated=2).pool_engine("colocated").kv_transfer.connector is None
    assert (
        serve_config(kv_offloading_size=1.0).pool_engine("decode").kv_transfer.connector == "nixl"
    )
    # tensor parallelism: every rank keeps its own tiers, lent to nobody (kvtransfer/tiers/ranks.py)
    tp = serve_config(colocated=2, kv_offloading_size=1.0, tensor_parallel_size=2)
    assert tp.pool_engine("colocated").kv_transfer.connector is None
    with pytest.raises(ValueError, match="need kv_connector unset"):
        serve_config(prefill=1, decode=1, kv_offloading_size=1.0, tensor_parallel_size=2)


def test_a_prefill_engine_reads_peers_tiers_when_another_pool_keeps_one():
    from tandem.workers.parallel.connector_hook import kv_role

    # only the decode pool keeps a host tier: the prefill engine borrows from it
    borrow = serve_config(decode_engine={"kv_offloading_size": 1.0})
    p, d = borrow.pool_engine("prefill"), borrow.pool_engine("decode")
    assert p.kv_transfer.borrows_tiers and not p.offload.kv_offloading_size
    assert (kv_role(p), kv_role(d)) == ("both", "both")
    # no tier anywhere, no pool moves: a prefill engine only serves, a decode engine only
    # reads (with moves, the default, both do both: tests/cluster/test_pool_move_config.py)
    plain = serve_config(pool_moves=False)
    assert not plain.pool_engine("prefill").kv_transfer.borrows_tiers
    assert (kv_role(plain.pool_engine("prefill")), kv_role(plain.pool_engine("decode"))) == (
        "prefill",
        "decode",
    )
    assert not borrow.pool_engine("decode").kv_transfer.borrows_tiers  # it reads anyway
