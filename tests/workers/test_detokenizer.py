"""Text side: incremental detokenizer, stop strings, tokenizer loading, chat templates.

Tokenizers are built locally with the `tokenizers` library (no network):
a byte-level BPE (GPT-2 / Llama-3 style) and a SentencePiece-style BPE with
Metaspace and 256 byte-fallback tokens (Llama-2 style).
"""

from __future__ import annotations

import json
import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from tandem.workers.text.detokenizer import IncrementalDetokenizer, _whole_token_text
from tandem.workers.text.tokenizer import (
    FALLBACK_CHAT_TEMPLATE,
    apply_chat_template,
    encode_prompt,
    load_tokenizer,
)

_ASCII_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world, hello there! Stop here. STOP means stop.",
    "We stream tokens to the client as soon as they are decided.",
]
_CORPUS = _ASCII_CORPUS + [
    "你好世界，今天天气很好。我们去公园散步吧。",
    "I love 🤗 and 🚀 and 👩‍💻 coding 😀😀 naïve café",
]
_SAMPLE_WORDS = [
    "the", "quick", "fox", " ", "Hello", "world", "STOP", "ST", "你好", "世界",
    "散步", "🤗", "🚀", "🦀", "👩‍💻", "é", "café", "\n", "  ", "。", "!", "Ω", "𝄞",
]  # fmt: skip


@pytest.fixture(scope="module")
def byte_bpe() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|bos|>", "<|eos|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 5, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>")


@pytest.fixture(scope="module")
def byte_fallback() -> PreTrainedTokenizerFast:
    """Metaspace BPE trained on ASCII text + <0x00>..<0xFF>: non-ASCII is bytes."""
    trained = Tokenizer(models.BPE(unk_token="<unk>"))
    trained.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(
        vocab_size=150, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
    )
    trained.train_from_iterator(_ASCII_CORPUS * 5, trainer)
    model = json.loads(trained.to_str())["model"]
    vocab = dict(model["vocab"])
    for byte in range(256):
        vocab[f"<0x{byte:02X}>"] = len(vocab)
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in model["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def _random_text(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choice(_SAMPLE_WORDS) for _ in range(num_words))


def _stream(detok: IncrementalDetokenizer, ids: list[int], rng: random.Random) -> list[str]:
    """Feed ``ids`` in random chunks of 1-3 tokens; deltas including finish()."""
    deltas, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 3)
        deltas.append(detok.update(ids[i : i + n]))
        i += n
        if detok.stop_matched is not None:
            break
    deltas.append(detok.finish())
    return deltas


def _decode(tokenizer, ids, skip_special_tokens=True):
    return tokenizer.decode(
        ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
    )


@pytest.mark.parametrize("name", ["byte_bpe", "byte_fallback"])
def test_multibyte_chars_split_across_tokens_never_break(name, request):
    tokenizer = request.getfixturevalue(name)
    ids = tokenizer.encode("I love 🤗 你好 🦀!", add_special_tokens=False)
    pieces = [_decode(tokenizer, [i]) for i in ids]
    assert any("\ufffd" in p for p in pieces)  # the setup really splits characters
    detok = IncrementalDetokenizer(tokenizer, [])
    deltas = [detok.update([i]) for i in ids] + [detok.finish()]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == detok.text == "I love 🤗 你好 🦀!"


@pytest.mark.parametrize("name", ["byte_bpe", "byte_fallback"])
def test_random_texts_stream_to_the_decoded_text(name, request):
    tokenizer = request.getfixturevalue(name)
    rng = random.Random(0)
    eos = tokenizer.eos_token_id
    for _ in range(150):
        prompt_ids = tokenizer.encode(_random_text(rng, rng.randint(0, 6)))
        output_ids = tokenizer.encode(
            _random_text(rng, rng.randint(1, 12)), add_special_tokens=False
        )
        if rng.random() < 0.3:  # a special token, between characters
            cuts = [
                i
                for i in range(len(output_ids) + 1)
                if not _decode(tokenizer, output_ids[:i]).endswith("\ufffd")
            ]
            output_ids.insert(rng.choice(cuts), eos)
        for skip in (True, False):
            detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=skip)
            deltas = _stream(detok, output_ids, rng)
            full = _decode(tokenizer, prompt_ids + output_ids, skip)
            expected = full[len(_decode(tokenizer, prompt_ids, skip)) :]
            assert "".join(deltas) == detok.text == expected
            assert "\ufffd" not in detok.text
            if not prompt_ids:
                assert detok.text == _decode(tokenizer, output_ids, skip)


def test_without_kept_text_the_deltas_are_the_same(byte_bpe):
    """``keep_text=False`` (the gateway's: it streams the deltas) changes no delta, one
    token at a time as the gateway feeds them, after any prompt cut (one that ends
    inside a character too: the prompt's context is decoded when the first token
    needs it), with special tokens between; ``text`` is then not available."""
    rng = random.Random(2)
    eos = byte_bpe.eos_token_id
    for _ in range(150):
        ids = byte_bpe.encode(_random_text(rng, rng.randint(2, 14)), add_special_tokens=False)
        cut = rng.randint(0, len(ids))
        prompt_ids, output_ids = ids[:cut], ids[cut:]
        if rng.random() < 0.3:
            output_ids.insert(rng.randint(0, len(output_ids)), eos)
        for skip in (True, False):
            kept = IncrementalDetokenizer(byte_bpe, prompt_ids, skip_special_tokens=skip)
            lean = IncrementalDetokenizer(
                byte_bpe, prompt_ids, skip_special_tokens=skip, keep_text=False
            )
            deltas = [kept.update([i]) for i in output_ids] + [kept.finish()]
            assert [lean.update([i]) for i in output_ids] + [lean.finish()] == deltas
            full = _decode(byte_bpe, prompt_ids + output_ids, skip)
            assert "".join(deltas) == kept.text == full[len(_decode(byte_bpe, prompt_ids, skip)) :]
    with pytest.raises(AttributeError, match="keep_text"):
        _ = lean.text


def test_arbitrary_token_ids_concatenate_to_decode(byte_bpe):
    """Random ids form invalid UTF-8 too: deltas still add up to decode(all).

    (Byte-level BPE only: a ByteFallback decoder turns a whole run of byte
    tokens into U+FFFD when any part of it is invalid, so an invalid byte can
    change text that a stream has already sent.)
    """
    rng = random.Random(1)
    vocab_size = len(byte_bpe)
    for _ in range(200):
        ids = [rng.randrange(vocab_size) for _ in range(rng.randint(1, 30))]
        detok = IncrementalDetokenizer(byte_bpe, [])
        assert "".join(_stream(detok, ids, rng)) == _decode(byte_bpe, ids)


def test_sentencepiece_keeps_leading_space_after_prompt(byte_fallback):
    prompt_ids = byte_fallback.encode("Hello", add_special_tokens=True)
    output_ids = byte_fallback.encode("Hello world", add_special_tokens=False)[1:]
    assert _decode(byte_fallback, output_ids) == "world"  # alone: leading space stripped
    detok = IncrementalDetokenizer(byte_fallback, prompt_ids)
    deltas = [detok.update([i]) for i in output_ids] + [detok.finish()]
    assert deltas[0].startswith(" w")
    assert "".join(deltas) == " world"


def test_update_cost_is_bounded_by_new_tokens(byte_bpe):
    """Windows stay short however long the output: O(new tokens) per update."""
    decoded_lengths: list[int] = []
    detok = IncrementalDetokenizer(byte_bpe, list(range(100)))
    decode = detok._decode
    detok._decode = lambda ids: decoded_lengths.append(len(ids)) or decode(ids)
    rng = random.Random(2)
    ids = byte_bpe.encode(_random_text(rng, 600), add_special_tokens=False)
    for token_id in ids:
        detok.update([token_id])
    assert len(ids) > 1000
    assert max(decoded_lengths) <= 8
    assert len(decoded_lengths) <= 2 * len(ids)
    assert detok.text + detok.finish() == _decode(byte_bpe, ids)


def _ids_for(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("name", ["byte_bpe", "byte_fallback"])
def test_stop_string_across_token_boundaries(name, request):
    tokenizer = request.getfixturevalue(name)
    text = "Hello world. ST is not it, STOP here"
    ids = _ids_for(tokenizer, text)
    for include in (False, True):
        detok = IncrementalDetokenizer(
            tokenizer, [], stop=["STOP"], include_stop_str_in_output=include
        )
        deltas = []
        for num_fed in range(1, len(ids) + 1):
            deltas.append(detok.update(ids[num_fed - 1 : num_fed]))
            if detok.stop_matched:
                break
            # Held back: exactly the longest tail that could still begin "STOP".
            decoded = _decode(tokenizer, ids[:num_fed])
            held = max(n for n in range(4) if decoded.endswith("STOP"[:n]))
            assert detok.text == decoded[: len(decoded) - held]
        assert detok.stop_matched == "STOP"
        assert detok.update(_ids_for(tokenizer, " more")) == ""
        assert detok.finish() == ""
        expected = "Hello world. ST is not it, STOP" if include else "Hello world. ST is not it, "
        assert "".join(deltas) == detok.text == expected


def test_stop_string_held_prefix_is_flushed_by_finish(byte_bpe):
    detok = IncrementalDetokenizer(byte_bpe, [], stop=["STOP"])
    ids = _ids_for(byte_bpe, "abc ST")
    emitted = "".join(detok.update([i]) for i in ids)
    assert emitted == "abc "
    assert detok.finish() == "ST"
    assert detok.text == "abc ST" and detok.stop_matched is None


def test_stop_at_first_token(byte_bpe):
    ids = _ids_for(byte_bpe, "Hello world")
    first = _decode(byte_bpe, ids[:1])
    for include in (False, True):
        detok = IncrementalDetokenizer(
            byte_bpe, [1], stop=[first], include_stop_str_in_output=include
        )
        assert detok.update(ids[:1]) == (first if include else "")
        assert detok.stop_matched == first
        assert detok.update(ids[1:]) == "" and detok.finish() == ""
        assert detok.text == (first if include else "")


def test_earliest_of_several_stops_wins_and_multibyte_stops(byte_bpe):
    ids = _ids_for(byte_bpe, "I love 🤗 你好 and STOP")
    detok = IncrementalDetokenizer(byte_bpe, [], stop=["STOP", "你好", "🤗 你"])
    deltas = [detok.update([i]) for i in ids]
    assert detok.stop_matched == "🤗 你"
    assert "".join(deltas) == detok.text == "I love "
    assert all("\ufffd" not in d for d in deltas)

    detok = IncrementalDetokenizer(byte_bpe, [], stop=["好 a"], include_stop_str_in_output=True)
    assert "".join(_stream(detok, ids, random.Random(3))) == "I love 🤗 你好 a"


def test_stop_string_inside_one_update_truncates_the_rest(byte_fallback):
    ids = _ids_for(byte_fallback, "the fox. the dog. the end")
    detok = IncrementalDetokenizer(byte_fallback, [], stop=["."])
    assert detok.update(ids) == "the fox"
    assert detok.stop_matched == "."


# ---- tokenizer.py ------------------------------------------------------------------------


def test_load_tokenizer_from_local_directory(byte_bpe, tmp_path):
    byte_bpe.save_pretrained(tmp_path)
    loaded = load_tokenizer(str(tmp_path))
    text = "Hello 你好 🤗"
    assert encode_prompt(loaded, text) == byte_bpe.encode(text)
    with pytest.raises(OSError):
        load_tokenizer(str(tmp_path / "missing"))


_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}"
)


def test_chat_template_renders_then_encodes_without_extra_bos(byte_fallback):
    byte_fallback.chat_template = _TEMPLATE
    try:
        messages = [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "你好"}]},
        ]  # fmt: skip
        ids = apply_chat_template(byte_fallback, messages)
        rendered = "<s>[system]Be brief.</s>[user]Hi\n你好</s>[assistant]"
        assert ids == byte_fallback.encode(rendered, add_special_tokens=False)
        assert ids.count(byte_fallback.bos_token_id) == 1
        no_prompt = apply_chat_template(byte_fallback, messages, add_generation_prompt=False)
        assert no_prompt == byte_fallback.encode(
            rendered[: -len("[assistant]")], add_special_tokens=False
        )
    finally:
        byte_fallback.chat_template = None


def test_chat_without_template_falls_back_or_raises(byte_bpe):
    assert not byte_bpe.chat_template
    messages = [{"role": "user", "content": "Hello"}]
    ids = apply_chat_template(byte_bpe, messages)
    assert byte_bpe.decode(ids) == "<|bos|><|user|>\nHello\n<|assistant|>\n"
    assert "bos_token" in FALLBACK_CHAT_TEMPLATE
    with pytest.raises(ValueError, match="no chat template"):
        apply_chat_template(byte_bpe, messages, allow_fallback=False)


@pytest.mark.parametrize(
    ("messages", "field"),
    [
        ([], "non-empty list"),
        ("hi", "non-empty list"),
        (["hi"], r"messages\[0\] must be an object"),
        ([{"role": "user", "content": "a"}, {"content": "b"}], r"messages\[1\]\.role is missing"),
        ([{"role": 3, "content": "a"}], r"messages\[0\]\.role must be"),
        ([{"role": "user"}], r"messages\[0\]\.content is missing"),
        ([{"role": "user", "content": None}], r"messages\[0\]\.content is missing"),
        ([{"role": "user", "content": 5}], r"messages\[0\]\.content must be"),
        ([{"role": "user", "content": [{"type": "image_url"}]}], r"messages\[0\]\.content\[0\]"),
        ([{"role": "user", "content": [{"type": "text"}]}], r"messages\[0\]\.content\[0\]\.text"),
    ],
)
def test_malformed_messages_name_the_field(byte_bpe, messages, field):
    with pytest.raises(ValueError, match=field):
        apply_chat_template(byte_bpe, messages)


def test_template_exceptions_become_value_errors(byte_bpe):
    byte_bpe.chat_template = "{{ raise_exception('roles must alternate') }}"
    try:
        with pytest.raises(ValueError, match="roles must alternate"):
            apply_chat_template(byte_bpe, [{"role": "user", "content": "x"}])
    finally:
        byte_bpe.chat_template = None


def test_whole_tokens_skip_the_decoder_on_byte_level_bpe(byte_bpe, byte_fallback):
    """Byte-level BPE: a token whose bytes are whole UTF-8 is emitted from a per-id
    cache without decoding (after the first sight of that id); split characters and
    added tokens still go through the window. SentencePiece gets no such cache."""
    assert _whole_token_text(byte_fallback) is None
    token_text = _whole_token_text(byte_bpe)
    assert token_text is _whole_token_text(byte_bpe)  # one cache per tokenizer
    special = byte_bpe.bos_token_id
    assert token_text(special) is None
    emoji = byte_bpe.encode("🦀", add_special_tokens=False)
    assert len(emoji) > 1 and all(token_text(i) is None for i in emoji)  # partial bytes

    def run(text: str) -> list[int]:
        ids = byte_bpe.encode(text, add_special_tokens=False)
        detok = IncrementalDetokenizer(byte_bpe, [special])
        calls: list[int] = []
        decode = detok._decode
        detok._decode = lambda window: calls.append(len(window)) or decode(window)
        deltas = [detok.update([i]) for i in ids] + [detok.finish()]
        assert "".join(deltas) == detok.text == text
        return [i for i in ids if token_text(i) is None], calls

    partial, calls = run("The quick brown fox said: stop. Hello world! " * 8)
    assert partial == [] and calls == []  # every token from the cache
    partial, calls = run("The quick brown fox 🦀 said: stop. Hello world! " * 8)
    assert len(partial) >= 8  # the crabs' byte tokens
    assert 0 < len(calls) <= 2 * len(partial)  # only they reach the decoder
