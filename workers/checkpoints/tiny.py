"""The built-in ``tiny`` model: a small random Llama checkpoint in HF format.

``ensure_tiny_model()`` writes it once to ``$TANDEM_CACHE_DIR/tiny-v1``
(default ``~/.cache/tandem/tiny-v1``) and returns that directory, so every
test and demo runs offline. The directory appears atomically (built in a
temporary sibling, then renamed), so concurrent processes are safe: the
losers of the race discard their copy.

Weights are deterministic: drawn from a seeded ``torch.Generator`` in sorted
parameter-name order, independent of transformers' init code. The
tokenizer is byte-level: token id ``b`` is byte ``b`` (0-255), then
``<s>`` 256, ``</s>`` 257, ``<pad>`` 258, ``<|system|>`` 259, ``<|user|>``
260, ``<|assistant|>`` 261; any UTF-8 text round-trips.
Bump ``TINY_VERSION`` (``cache_dir.py``) whenever the contents change.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from tandem.workers.checkpoints.cache_dir import TINY_VERSION, built_tiny_dir, default_cache_dir

SEED = 1234
WEIGHT_STD = 0.25  # large enough that greedy decoding does not stick on one token
SPECIAL_TOKENS = ["<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>"]
BOS_ID, EOS_ID, PAD_ID = 256, 257, 258
VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|{{ message['role'] }}|>{{ message['content'] }}</s>"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
TINY_CONFIG: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "bos_token_id": BOS_ID,
    "eos_token_id": EOS_ID,
    "pad_token_id": PAD_ID,
}


def ensure_tiny_model(cache_dir: str | None = None) -> str:
    """Path of the tiny checkpoint under ``cache_dir`` (default above), built if absent."""
    built = built_tiny_dir(cache_dir)
    if built is not None:
        return built
    root = Path(cache_dir or default_cache_dir())
    final = root / TINY_VERSION
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{TINY_VERSION}-", dir=root))
    try:
        write_tiny_checkpoint(str(tmp))
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "config.json").is_file():  # not a lost race: a real error
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(final)


def write_tiny_checkpoint(out_dir: str, seed: int = SEED, **config_overrides: Any) -> None:
    """Write config, safetensors weights and tokenizer into ``out_dir``. Another
    ``seed`` or shape (``config_overrides``: e.g. ``num_hidden_layers``) gives another
    random model with the same tokenizer (tests use one as a draft model)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    settings = {**TINY_CONFIG, **config_overrides}
    vocab_size = settings["vocab_size"]
    config = LlamaConfig(**settings, architectures=["LlamaForCausalLM"], dtype="float32")
    model = LlamaForCausalLM(config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.state_dict().items()):
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=generator) * WEIGHT_STD)
        # Shrink the output rows of all but printable ASCII so greedy output
        # is mostly readable text (valid UTF-8) rather than random bytes.
        readable = torch.zeros(vocab_size, dtype=torch.bool)
        readable[32:127] = True
        readable[10] = True
        model.lm_head.weight[~readable] *= 0.25
    model.generation_config.do_sample = False
    model.save_pretrained(out_dir)
    build_tokenizer().save_pretrained(out_dir)


def build_tokenizer() -> Any:
    """Byte-level ``PreTrainedTokenizerFast`` (adds ``<s>`` in front by default)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    byte_chars = _byte_to_char()
    vocab = {byte_chars[b]: b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS_ID)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        clean_up_tokenization_spaces=False,
        chat_template=CHAT_TEMPLATE,
    )


def _byte_to_char() -> dict[int, str]:
    # The byte -> printable character table of byte-level BPE (GPT-2): bytes
    # that are printable Latin-1 map to themselves, the rest to U+0100 onward
    # in byte order. tokenizers' ByteLevel pre-tokenizer uses this table.
    printable = {
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    }
    table: dict[int, str] = {}
    num_shifted = 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + num_shifted)
            num_shifted += 1
    return table
