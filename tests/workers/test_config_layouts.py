"""config.json variants real checkpoints ship: no ``architectures`` (resolve by
``model_type``), old ``rope_theta``/``rope_scaling`` vs new ``rope_parameters``,
and end ids that only ``generation_config.json`` names."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tandem.workers.checkpoints.hf_config import load_config
from tandem.workers.checkpoints.loader import load_model
from tests.workers.hf_checkpoints import hf_logits, load_hf_model
from tests.workers.paged_session import PagedSession

TOKENS = [5, 17, 42, 99, 3, 250, 7, 64, 128, 11, 2, 33]


def _edit_config(path: str, edit) -> None:
    file = Path(path) / "config.json"
    config = json.loads(file.read_text())
    edit(config)
    file.write_text(json.dumps(config))


def _our_logits(path: str) -> torch.Tensor:
    model, _ = load_model(path, dtype="float32")
    return PagedSession(model, block_size=4).step({0: TOKENS})[0]


def test_config_without_architectures_resolves_by_model_type(make_checkpoint):
    path = make_checkpoint("qwen2", seed=5)
    expected = hf_logits(load_hf_model(path), TOKENS)
    _edit_config(path, lambda c: c.pop("architectures"))
    model, config = load_model(path, dtype="float32")
    assert type(model).__name__ == "Qwen2ForCausalLM" and not config.architectures
    torch.testing.assert_close(_our_logits(path), expected, rtol=1e-4, atol=1e-4)


def test_old_and_new_rope_layouts_give_the_same_model(make_checkpoint):
    scaling = {"rope_type": "linear", "factor": 2.0}
    new = make_checkpoint("llama", seed=6)
    _edit_config(
        new,
        lambda c: (
            c.pop("rope_theta", None),
            c.pop("rope_scaling", None),
            c.update(rope_parameters={"rope_theta": 5000.0, **scaling}),
        ),
    )
    old = make_checkpoint("llama", seed=6)
    _edit_config(
        old,
        lambda c: (
            c.pop("rope_parameters", None),
            c.update(rope_theta=5000.0, rope_scaling={"type": "linear", "factor": 2.0}),
        ),
    )
    expected = hf_logits(load_hf_model(new), TOKENS)
    torch.testing.assert_close(hf_logits(load_hf_model(old), TOKENS), expected)
    torch.testing.assert_close(_our_logits(new), expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(_our_logits(old), expected, rtol=1e-4, atol=1e-4)
    default = make_checkpoint("llama", seed=6)  # theta 10000, no scaling: a different model
    assert not torch.allclose(_our_logits(default), expected, atol=1e-3)


def test_generation_config_end_ids_join_the_config_eos(make_checkpoint):
    path = make_checkpoint("llama", eos_token_id=2)
    (Path(path) / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7, 9]}))
    assert load_config(path).eos_token_id == [2, 7, 9]
    (Path(path) / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    assert load_config(path).eos_token_id == 2
