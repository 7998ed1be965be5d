"""Loader: path resolution, safetensors (single and sharded), dtype, clear errors, and the
model an engine builds from the gateway's plain config."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tandem.workers.checkpoints import loader
from tandem.workers.checkpoints.hf_config import config_namespace, end_token_ids, plain_config
from tandem.workers.checkpoints.loader import load_model, resolve_dtype, resolve_model_path
from tests.workers import hf_checkpoints
from tests.workers.paged_session import PagedSession


def _builtin_only(value) -> bool:
    if isinstance(value, dict):
        return all(_builtin_only(k) and _builtin_only(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return all(_builtin_only(v) for v in value)
    return value is None or type(value) in (str, int, float, bool)


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return dict(model.hf_weight_slots())


def test_sharded_checkpoint_loads_like_single_file(make_checkpoint):
    single = make_checkpoint("qwen3", seed=3)
    sharded = make_checkpoint("qwen3", seed=3, max_shard_size="40KB")
    index = json.loads((Path(sharded) / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert not (Path(sharded) / "model.safetensors").exists()
    a, _ = load_model(single, dtype="float32")
    b, config = load_model(sharded, dtype="float32")
    assert config.architectures == ["Qwen3ForCausalLM"]
    pa, pb = _params(a), _params(b)
    assert pa.keys() == pb.keys()
    for name in pa:
        assert torch.equal(pa[name], pb[name]), name


def test_missing_shard_is_named(make_checkpoint):
    path = make_checkpoint("llama", max_shard_size="40KB")
    shard = sorted(Path(path).glob("*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=shard.name):
        load_model(path)


def test_missing_directory():
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model("/nonexistent/tandem-model")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_model_path("./no-such-dir")


def test_missing_config_and_missing_weights(make_checkpoint, tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_model(str(tmp_path))
    path = make_checkpoint("llama")
    (Path(path) / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"no \*.safetensors"):
        load_model(path)


def test_unsupported_architecture(make_checkpoint):
    path = Path(make_checkpoint("llama"))
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["FancyNewForCausalLM"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="FancyNewForCausalLM.*supported: LlamaForCausalLM"):
        load_model(str(path))


def test_missing_weight_is_named(make_checkpoint):
    path = Path(make_checkpoint("mistral"))
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.mlp.gate_proj.weight"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="missing weight.*model.layers.1.mlp.gate_proj.weight"):
        load_model(str(path))


def test_unexpected_shape_is_named(make_checkpoint):
    path = Path(make_checkpoint("llama"))
    config = json.loads((path / "config.json").read_text())
    config["intermediate_size"] = 96
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ValueError,
        match=r"weight .model.layers.0.mlp.down_proj.weight.: expected shape \(64, 96\), checkpoint has \(64, 128\)",
    ):
        load_model(str(path))


def test_old_checkpoint_extras_are_ignored(make_checkpoint):
    path = Path(make_checkpoint("llama"))
    tensors = load_file(path / "model.safetensors")
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    load_model(str(path))


def test_max_model_len_beyond_sliding_window_is_rejected(make_checkpoint):
    path = make_checkpoint("mistral", sliding_window=64)
    model, _ = load_model(path, max_model_len=64)
    assert model.max_context_len == 64
    with pytest.raises(ValueError, match="max_model_len 65 exceeds.*64"):
        load_model(path, max_model_len=65)
    with pytest.raises(ValueError, match="max_model_len 513"):
        load_model(make_checkpoint("llama"), max_model_len=513)


@pytest.mark.parametrize(
    ("requested", "configured", "device", "expected"),
    [
        ("auto", "float16", "cpu", torch.float32),  # CPU fp16 matmul is slow
        ("auto", "float16", "cuda", torch.float16),
        ("auto", "bfloat16", "cpu", torch.bfloat16),
        ("auto", None, "cpu", torch.float32),
        ("float16", "float32", "cpu", torch.float16),
        ("bf16", "float32", "cpu", torch.bfloat16),
        (torch.float32, "bfloat16", "cpu", torch.float32),
    ],
)
def test_resolve_dtype(requested, configured, device, expected):
    class Config:
        dtype = configured

    assert resolve_dtype(requested, Config(), device) == expected


def test_unknown_dtype_is_rejected(make_checkpoint):
    with pytest.raises(ValueError, match="unknown dtype 'int8'"):
        load_model(make_checkpoint("llama"), dtype="int8")


def test_dtype_auto_follows_config(make_checkpoint):
    path = Path(make_checkpoint("llama"))
    config = json.loads((path / "config.json").read_text())
    config["dtype"] = "bfloat16"
    (path / "config.json").write_text(json.dumps(config))
    model, _ = load_model(str(path))
    assert model.dtype == torch.bfloat16
    assert model.model.norm.weight.dtype == torch.bfloat16


def test_resolve_local_dir_and_tiny(tmp_path, monkeypatch):
    assert resolve_model_path(str(tmp_path)) == str(tmp_path)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "m").mkdir()
    assert resolve_model_path("m") == str(tmp_path / "m")
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    assert resolve_model_path("tiny") == str(tmp_path / "cache" / "tiny-v1")


def test_hub_id_resolves_from_local_hf_cache(make_checkpoint, tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    ckpt = Path(make_checkpoint("llama"))
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--tandem-test--tiny-llama"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for f in ckpt.iterdir():
        os.link(f, snapshot / f.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    resolved = resolve_model_path("tandem-test/tiny-llama", cache_dir=str(tmp_path / "hub"))
    assert Path(resolved) == snapshot


def test_unknown_hub_id_gives_clear_error(tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ValueError, match="'tandem-test/no-such-model' is not 'tiny'.*hub"):
        loader.resolve_model_path("tandem-test/no-such-model", cache_dir=str(tmp_path))


@pytest.mark.parametrize("arch", sorted(hf_checkpoints.ARCH_PRESETS))
def test_model_from_the_plain_config_equals_the_directorys(make_checkpoint, arch):
    """What an engine actor builds from the gateway's ``plain_config`` (a namespace, no
    transformers configuration class) is the model its directory's config builds: same class,
    same weights, same logits, same end ids."""
    path = make_checkpoint(arch, seed=5)
    plain = plain_config(path)
    assert _builtin_only(plain)  # it travels to the engine without naming a transformers class
    a, config = load_model(path, dtype="float32")
    b, namespace = load_model(path, dtype="float32", hf_config=config_namespace(plain))
    assert type(a) is type(b)
    assert end_token_ids(namespace) == end_token_ids(config)
    assert a.max_context_len == b.max_context_len
    ids = [1, 5, 9, 2, 7, 3, 11, 4]
    assert torch.equal(PagedSession(a, block_size=4).step({0: ids})[0],
                       PagedSession(b, block_size=4).step({0: ids})[0])  # fmt: skip
