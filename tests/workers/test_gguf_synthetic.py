"""GGUF files written from small random HF checkpoints, one per tensor type:
our converted weights equal transformers' loading of the same file bit for
bit, F32 files give back the original checkpoint exactly (names and the
Llama q/k row order), and greedy tokens match transformers end to end."""

from __future__ import annotations

import os

import pytest
import torch

from tandem.wire.engine_protocol import SamplingParams
from tandem.workers.checkpoints.gguf_convert import ensure_converted
from tandem.workers.checkpoints.loader import load_model
from tandem.workers.config import EngineConfig
from tandem.workers.engine.llm import LLM
from tests.workers.gguf_writer import write_gguf_from_hf

QUANTIZED = ["F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"]
K_QUANTS = ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]  # gguf cannot encode these: random blocks
WIDE = {"hidden_size": 256, "intermediate_size": 256}  # K-quant blocks hold 256 weights


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))


def transformers_weights(gguf_path: str) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    folder, name = os.path.split(gguf_path)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    return model.state_dict()


def our_weights(gguf_path: str) -> dict[str, torch.Tensor]:
    model, _ = load_model(gguf_path, dtype="float32")
    return {k: v.detach().clone() for k, v in model.hf_weight_slots().items()}


def assert_bitwise_equal(ours: dict, theirs: dict) -> None:
    for name, tensor in ours.items():
        expected = theirs[name]
        assert tensor.shape == expected.shape, name
        # bit patterns: random K-quant blocks may decode to NaN/inf
        assert torch.equal(tensor.view(torch.int32), expected.view(torch.int32)), name


def test_f32_gguf_gives_back_the_hf_checkpoint(make_checkpoint, tmp_path, cache):
    for arch in ("llama", "qwen3", "qwen2_tied"):
        hf_dir = make_checkpoint(arch, seed=1)
        path = tmp_path / f"{arch}.gguf"
        write_gguf_from_hf(hf_dir, path, "F32")
        original, _ = load_model(hf_dir, dtype="float32")
        expected = original.hf_weight_slots()
        ours = our_weights(str(path))
        assert ours.keys() == expected.keys()
        for name in ours:
            assert torch.equal(ours[name], expected[name]), (arch, name)


@pytest.mark.parametrize("qtype", QUANTIZED)
def test_dequantized_weights_equal_transformers(
    qtype, make_checkpoint, tmp_path, cache, monkeypatch
):
    # rows are dequantized in chunks; 7 rows per chunk makes every matrix several chunks
    monkeypatch.setattr("tandem.workers.checkpoints.gguf_file._ROWS_PER_CHUNK", 7)
    path = str(tmp_path / f"llama-{qtype}.gguf")
    write_gguf_from_hf(make_checkpoint("llama", seed=2), path, qtype)
    assert_bitwise_equal(our_weights(path), transformers_weights(path))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # random blocks decode to NaN/inf
def test_k_quants_and_other_architectures_equal_transformers(make_checkpoint, tmp_path, cache):
    for qtype in K_QUANTS:
        path = str(tmp_path / f"llama-{qtype}.gguf")
        write_gguf_from_hf(make_checkpoint("llama", **WIDE), path, qtype, random_bytes=True)
        assert_bitwise_equal(our_weights(path), transformers_weights(path))
    # transformers reads no head_dim for qwen3 from GGUF: its default (128) must be the size
    for arch, extra in (("qwen2", {}), ("qwen3", {"head_dim": 128})):
        path = str(tmp_path / f"{arch}.gguf")
        write_gguf_from_hf(make_checkpoint(arch, seed=3, **extra), path, "Q8_0")
        assert_bitwise_equal(our_weights(path), transformers_weights(path))


def test_greedy_tokens_equal_transformers_on_a_q4_0_file(make_checkpoint, tmp_path, cache):
    from transformers import AutoModelForCausalLM

    path = str(tmp_path / "llama-q4.gguf")
    write_gguf_from_hf(make_checkpoint("llama", seed=4), path, "Q4_0")
    prompt = [5, 17, 42, 99, 3, 250, 7, 64, 128, 11, 2, 33, 71, 12, 200, 9, 44, 45, 46, 1]
    llm = LLM(EngineConfig.from_flat(model=path, num_kv_blocks=32, max_num_batched_tokens=8))
    (ours,) = llm.generate(
        prompt_token_ids=[prompt],
        sampling_params=SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
    )
    folder, name = os.path.split(path)
    hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None
        )
    assert ours.token_ids == out[0, len(prompt) :].tolist()
    # the cached directory is reused by a copy of the file under another name
    again = tmp_path / "renamed.gguf"
    again.write_bytes(open(path, "rb").read())
    assert ensure_converted(str(again)) == ensure_converted(path) == llm.engine.model_path
