"""The built-in tiny model: written once, atomically, deterministic, byte-level
tokenizer that round-trips UTF-8, and our forward equal to transformers'."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.workers.checkpoints import tiny
from tandem.workers.checkpoints.loader import load_model
from tests.workers.hf_checkpoints import hf_logits, load_hf_model
from tests.workers.paged_session import PagedSession


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_written_once_in_hf_format(tiny_model_dir):
    path = Path(tiny_model_dir)
    assert path.name == "tiny-v1"
    files = {f.name for f in path.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= files
    assert not [f for f in path.parent.iterdir() if f.name.startswith(".tiny-v1")]
    mtime_ns = (path / "model.safetensors").stat().st_mtime_ns
    assert tiny.ensure_tiny_model(str(path.parent)) == tiny_model_dir
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime_ns


def test_weights_are_deterministic(tiny_model_dir, tmp_path):
    other = tiny.ensure_tiny_model(str(tmp_path))
    assert other != tiny_model_dir
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (Path(other) / name).read_bytes() == (Path(tiny_model_dir) / name).read_bytes()


def test_default_cache_dir_from_env(monkeypatch, tmp_path):
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    assert tiny.default_cache_dir() == str(tmp_path)
    monkeypatch.delenv("TANDEM_CACHE_DIR")
    assert tiny.default_cache_dir() == os.path.expanduser("~/.cache/tandem")


def test_losing_the_race_keeps_the_winner(tmp_path, monkeypatch):
    """Another process finishes first: our rename fails, we return its copy."""
    winner = Path(tiny.ensure_tiny_model(str(tmp_path / "a")))
    real_write = tiny.write_tiny_checkpoint
    final = tmp_path / "b" / "tiny-v1"

    def write_then_lose(out_dir: str) -> None:
        real_write(out_dir)
        os.rename(winner, final)  # the "other process" lands its copy now

    monkeypatch.setattr(tiny, "write_tiny_checkpoint", write_then_lose)
    assert tiny.ensure_tiny_model(str(tmp_path / "b")) == str(final)
    assert (final / "config.json").is_file()
    assert [f.name for f in final.parent.iterdir()] == ["tiny-v1"]  # temp dir removed


def test_concurrent_callers_get_one_directory(tmp_path):
    results: list[str] = []
    errors: list[BaseException] = []
    barrier = threading.Barrier(3, timeout=30)

    def call() -> None:
        try:
            barrier.wait()
            results.append(tiny.ensure_tiny_model(str(tmp_path)))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=call) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    assert not errors
    assert results == [str(tmp_path / "tiny-v1")] * 3
    assert [f.name for f in tmp_path.iterdir()] == ["tiny-v1"]


def test_tokenizer_ids_are_bytes_plus_specials(tokenizer):
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (
        256,
        257,
        258,
    )
    assert len(tokenizer) == tiny.VOCAB_SIZE
    assert tokenizer.encode("hé") == [256, 104, 0xC3, 0xA9]
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert text == "<s><|user|>hi</s><|assistant|>"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids == [256, 260, ord("h"), ord("i"), 257, 261]


@settings(max_examples=100, deadline=None)
@given(st.text())
def test_tokenizer_round_trips_utf8(tokenizer, text):
    if any(special in text for special in tiny.SPECIAL_TOKENS):
        return
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids == list(text.encode("utf-8"))
    assert tokenizer.decode(ids) == text
    with_bos = tokenizer.encode(text)
    assert tokenizer.decode(with_bos, skip_special_tokens=True) == text


def test_forward_and_greedy_generation_equal_transformers(tiny_model_dir):
    model, config = load_model(tiny_model_dir)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.dtype == torch.float32
    hf_model = load_hf_model(tiny_model_dir)
    prompt = [256, *b"Once upon a time"]
    num_new = 24
    with torch.inference_mode():
        hf_ids = hf_model.generate(
            torch.tensor([prompt]), max_new_tokens=num_new, do_sample=False, min_new_tokens=num_new
        )[0].tolist()
    generated = hf_ids[len(prompt) :]
    assert len(set(generated)) > 4  # not one token repeated forever

    expected = hf_logits(hf_model, hf_ids)
    session = PagedSession(model, block_size=16)
    logits = session.step({0: prompt})[0]
    torch.testing.assert_close(logits, expected[: len(prompt)], atol=1e-4, rtol=0)
    ours = []
    for _ in range(num_new):
        ours.append(int(logits[-1].argmax()))
        logits = session.step({0: [ours[-1]]})[0]
    assert ours == generated
