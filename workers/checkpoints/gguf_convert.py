"""GGUF file -> HF checkpoint directory, converted once and cached.

    ensure_converted("/models/x.Q4_1.gguf") -> "$TANDEM_CACHE_DIR/gguf-v1/x.Q4_1-<sha256[:16]>"

(an entry is found by the hash part alone, whatever the file is called).

The directory is an ordinary HF checkpoint, so everything downstream (the
loader, the tokenizer, the gateway) treats a GGUF model like any other:

    config.json             transformers' reading of the GGUF metadata, plus
                            ``architectures`` (from model_type) and dtype float32
    generation_config.json  BOS, PAD and every end id the file names (eos, eot, eom)
    tokenizer.json ...      transformers' conversion of the GGUF vocabulary,
                            merges and chat template
    model.safetensors       every tensor dequantized to float32 (exact for all
                            supported types); the engine casts to its dtype at load
    source.json             the GGUF path and sha256 it came from

Why cache: reading the metadata and converting the tokenizer takes seconds
(transformers parses the 49k-entry vocabulary twice) and dequantizing takes
about a second per 100 M weights; a later start, P and D engines included,
reads the cached directory in a fraction of that. The cache key is the
file's sha256, so a copy of the same file elsewhere reuses the entry and a
changed file gets a new one.

Memory: tensors go from the GGUF memory map through the dequantizer to
disk one at a time (``write_safetensors_streaming``); the engine later
loads them one at a time into its parameters. At no point do two full
copies of the weights exist.

Atomicity: the directory is built under a temporary name beside the final
one and renamed into place; a failure removes the temporary directory, and
concurrent starts race harmlessly (the loser discards its copy). Every
check on the file runs before anything is created.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from tandem.workers.checkpoints.gguf_file import (
    GGUFError,
    iter_hf_tensors,
    metadata,
    open_gguf,
    tensor_shapes,
)
from tandem.workers.checkpoints.safetensors_stream import write_safetensors_streaming

logger = logging.getLogger(__name__)

CONVERTER_VERSION = "gguf-v1"  # bump when the converted layout changes
_DONE_FILE = "source.json"  # written last: its presence marks a complete entry
_HASH_CHUNK_BYTES = 8 << 20


def ensure_converted(gguf_path: str, cache_dir: str | None = None) -> str:
    """HF directory converted from ``gguf_path`` (built on first use, then reused).

    ``cache_dir`` defaults to ``$TANDEM_CACHE_DIR`` (else ``~/.cache/tandem``).
    Raises ``FileNotFoundError`` for a missing file and ``GGUFError`` (a
    ``ValueError`` naming the file and the cause) for one we cannot load;
    then nothing is left in the cache.
    """
    from tandem.workers.checkpoints.cache_dir import default_cache_dir

    source = os.path.abspath(os.path.expanduser(gguf_path))
    if not os.path.isfile(source):
        raise FileNotFoundError(f"{gguf_path}: no such GGUF file")
    digest = file_sha256(source)
    root = Path(cache_dir or default_cache_dir()) / CONVERTER_VERSION
    # Found by content: a copy or link of a converted file under another name reuses it.
    for done in sorted(root.glob(f"*-{digest[:16]}/{_DONE_FILE}")):
        logger.info("GGUF %s: using the converted checkpoint in %s", source, done.parent)
        return str(done.parent)
    final = root / f"{Path(source).stem}-{digest[:16]}"
    reader = open_gguf(source)  # every check, before anything is created
    start_s = time.monotonic()
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=root))
    tmp.chmod(0o755)  # mkdtemp makes it private; the cache is shared
    try:
        _write_checkpoint(reader, source, str(tmp))
        (tmp / _DONE_FILE).write_text(
            json.dumps({"gguf": source, "sha256": digest, "converter": CONVERTER_VERSION})
        )
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / _DONE_FILE).is_file():  # not a lost race: a real error
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info(
        "GGUF %s: converted in %.1f s to %s (later starts load that directory)",
        source,
        time.monotonic() - start_s,
        final,
    )
    return str(final)


def file_sha256(path: str) -> str:
    """Hex sha256 of a file's bytes, read in chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK_BYTES):
            h.update(chunk)
    return h.hexdigest()


def _write_checkpoint(reader: Any, source: str, out_dir: str) -> None:
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    from tandem.workers.models import architecture_for_model_type

    folder, name = os.path.split(source)
    try:
        config = AutoConfig.from_pretrained(folder, gguf_file=name, local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - transformers raises many types on bad metadata
        raise GGUFError(
            source,
            f"transformers could not read its config/tokenizer ({type(exc).__name__}: {exc})",
        ) from exc
    config.architectures = [architecture_for_model_type(config.model_type)]
    # transformers maps head_dim from GGUF for llama only; qwen3's default (128) is
    # wrong for other sizes. The file states it for every architecture.
    head_dim = metadata(reader, f"{metadata(reader, 'general.architecture')}.attention.key_length")
    if head_dim is not None:
        config.head_dim = int(head_dim)
    config.dtype = "float32"
    config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    _generation_config(reader, config, GenerationConfig).save_pretrained(out_dir)
    write_safetensors_streaming(
        os.path.join(out_dir, "model.safetensors"), tensor_shapes(reader), iter_hf_tensors(reader)
    )


def _generation_config(reader: Any, config: Any, cls: type) -> Any:
    """End ids: the config's eos plus the file's eot/eom ids (end of turn / message)."""
    eos = config.eos_token_id
    end_ids = list(eos) if isinstance(eos, list) else ([] if eos is None else [eos])
    for key in (
        "tokenizer.ggml.eos_token_id",
        "tokenizer.ggml.eot_token_id",
        "tokenizer.ggml.eom_token_id",
    ):
        value = metadata(reader, key)
        if value is not None and int(value) not in end_ids:
            end_ids.append(int(value))
    return cls(
        bos_token_id=config.bos_token_id,
        eos_token_id=end_ids[0] if len(end_ids) == 1 else end_ids,
        pad_token_id=getattr(config, "pad_token_id", None),
    )
