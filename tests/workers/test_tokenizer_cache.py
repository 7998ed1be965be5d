"""``drop_whole_text_cache``: a BPE tokenizer whose pre-tokenizer keeps the
whole text as one word loses its word cache (it would hold whole prompts);
one that splits words keeps it; token ids never change."""

from __future__ import annotations

from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from tandem.workers.checkpoints.tiny import build_tokenizer, ensure_tiny_model
from tandem.workers.text.tokenizer import drop_whole_text_cache, load_tokenizer

PROMPTS = ["hello world", "the river and the city " * 20, "été, 東京", ""]


def test_whole_text_tokenizer_loses_its_cache_ids_unchanged():
    tok = build_tokenizer()  # ByteLevel, use_regex=False: a prompt is one word
    before = [tok.encode(p) for p in PROMPTS]
    assert drop_whole_text_cache(tok)
    assert [tok.encode(p) for p in PROMPTS] == before
    assert [tok.encode(p) for p in PROMPTS] == before  # no cache to hit either


def test_load_tokenizer_applies_it():
    tok = load_tokenizer(ensure_tiny_model())
    assert tok.encode("hello") == build_tokenizer().encode("hello")
    assert drop_whole_text_cache(tok)  # already off: still reported as a whole-text one


def test_word_splitting_tokenizer_keeps_its_cache():
    vocab = {"h": 0, "e": 1, "l": 2, "o": 3, "he": 4, "Ġ": 5}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("h", "e")]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    assert not drop_whole_text_cache(fast)
    no_model = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"a": 0}, "a")))
    assert not drop_whole_text_cache(no_model)
