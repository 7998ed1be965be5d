"""Our models vs transformers (the oracle) on random checkpoints, fp32.

Every step's logits must match transformers' full-sequence forward at the
same positions: whole-prompt prefill, one-token decode steps, chunked
prefill, and a mixed batch of several sequences in one step.
"""

from __future__ import annotations

import random

import pytest
import torch

from tandem.workers.checkpoints.loader import load_model
from tandem.workers.models import MODEL_REGISTRY, get_model_class
from tandem.workers.models.rope import inverse_frequencies, rope_settings
from tests.workers.hf_checkpoints import ARCH_PRESETS, hf_logits, load_hf_model, make_config
from tests.workers.paged_session import PagedSession

ATOL = 1e-4
PROMPT_LEN = 23
NUM_DECODE_STEPS = 4


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    """arch -> (our model, transformers model, token ids), built once per module."""
    from tests.workers.hf_checkpoints import make_checkpoint

    cache = {}

    def get(arch: str):
        if arch not in cache:
            path = make_checkpoint(arch, tmp_path_factory.mktemp(arch))
            model, config = load_model(path, dtype="float32")
            rng = random.Random(arch)
            ids = [rng.randrange(config.vocab_size) for _ in range(PROMPT_LEN + NUM_DECODE_STEPS)]
            cache[arch] = (model, load_hf_model(path), ids)
        return cache[arch]

    return get


@pytest.mark.parametrize("arch", list(ARCH_PRESETS))
def test_prefill_then_decode_matches_transformers(loaded, arch):
    model, hf_model, ids = loaded(arch)
    expected = hf_logits(hf_model, ids)
    session = PagedSession(model, block_size=4)
    got = session.step({0: ids[:PROMPT_LEN]})[0]
    torch.testing.assert_close(got, expected[:PROMPT_LEN], atol=ATOL, rtol=0)
    for pos in range(PROMPT_LEN, len(ids)):
        got = session.step({0: [ids[pos]]})[0]
        torch.testing.assert_close(got, expected[pos : pos + 1], atol=ATOL, rtol=0)


@pytest.mark.parametrize("arch", ["llama", "llama3", "qwen2_tied", "qwen3_bias"])
def test_chunked_prefill_matches_transformers(loaded, arch):
    model, hf_model, ids = loaded(arch)
    expected = hf_logits(hf_model, ids)
    session = PagedSession(model, block_size=16, seed=1)
    for start, end in [(0, 7), (7, 17), (17, len(ids))]:
        got = session.step({0: ids[start:end]})[0]
        torch.testing.assert_close(got, expected[start:end], atol=ATOL, rtol=0)


def test_mixed_batch_matches_transformers(loaded):
    """Prefill chunks and decodes of three sequences share each step."""
    model, hf_model, ids = loaded("llama")
    seqs = {0: ids, 1: ids[::-1], 2: ids[5:] + ids[:5]}
    expected = {s: hf_logits(hf_model, toks) for s, toks in seqs.items()}
    plan = [
        {0: (0, 10), 1: (0, 3)},
        {0: (10, 11), 1: (3, 20), 2: (0, 9)},
        {0: (11, 12), 1: (20, 21), 2: (9, 10)},
        {2: (10, 27), 0: (12, 13), 1: (21, 22)},
    ]
    session = PagedSession(model, block_size=4, seed=2)
    for step in plan:
        got = session.step({s: seqs[s][a:b] for s, (a, b) in step.items()})
        for s, (a, b) in step.items():
            torch.testing.assert_close(got[s], expected[s][a:b], atol=ATOL, rtol=0)


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "default"},
        {"rope_type": "linear", "factor": 4.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 128,
        },
    ],
)
def test_rope_inverse_frequencies_equal_transformers(rope):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = make_config("llama", rope_theta=500000.0, rope_scaling=rope, head_dim=16)
    theta, scaling = rope_settings(config)
    ours = inverse_frequencies(16, theta, scaling)
    if rope["rope_type"] == "default":
        base = 1.0 / (500000.0 ** (torch.arange(0, 16, 2).float() / 16))
        torch.testing.assert_close(ours, base, atol=0, rtol=0)
        return
    expected, attention_scaling = ROPE_INIT_FUNCTIONS[rope["rope_type"]](config, "cpu")
    assert attention_scaling == 1.0
    torch.testing.assert_close(ours, expected.float(), atol=0, rtol=1e-6)
    plain = inverse_frequencies(16, theta, {"rope_type": "default"})
    assert not torch.equal(ours, plain)  # the scaling really changes something


def test_unsupported_rope_type_is_rejected():
    config = make_config("llama", rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ValueError, match="yarn.*supported: default, linear, llama3"):
        get_model_class(config.architectures)(config, torch.float32)


def test_registry_names_unsupported_architecture():
    assert get_model_class(["Foo", "Qwen3ForCausalLM"]) is MODEL_REGISTRY["Qwen3ForCausalLM"]
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*LlamaForCausalLM.*Qwen3ForCausalLM"):
        get_model_class(["GPT2LMHeadModel"])
    with pytest.raises(ValueError, match="unsupported"):
        get_model_class(None)


def test_max_context_len_respects_sliding_window():
    cls = MODEL_REGISTRY["MistralForCausalLM"]
    assert cls(make_config("mistral", sliding_window=64), torch.float32).max_context_len == 64
    assert cls(make_config("mistral"), torch.float32).max_context_len == 512
    qwen = MODEL_REGISTRY["Qwen2ForCausalLM"]
    off = make_config("qwen2", sliding_window=64, use_sliding_window=False)
    assert qwen(off, torch.float32).max_context_len == 512


def test_load_weights_names_missing_unexpected_and_misshaped(loaded):
    model, hf_model, _ = loaded("qwen2")
    state = dict(hf_model.state_dict())
    fresh = type(model)(model.config, torch.float32)

    missing = {k: v for k, v in state.items() if k != "model.layers.1.self_attn.k_proj.bias"}
    with pytest.raises(ValueError, match=r"1 missing weight\(s\): model.layers.1.self_attn.k_proj"):
        fresh.load_weights(missing.items())

    extra = {**state, "model.layers.7.mlp.up_proj.weight": torch.zeros(1)}
    with pytest.raises(ValueError, match="unexpected weight.*model.layers.7.mlp.up_proj.weight"):
        fresh.load_weights(extra.items())

    bad = {**state, "model.norm.weight": torch.zeros(65)}
    with pytest.raises(ValueError, match=r"model.norm.weight.*\(64,\).*\(65,\)"):
        fresh.load_weights(bad.items())

    fresh.load_weights(state.items())
    for name, slot in fresh.hf_weight_slots().items():
        assert torch.equal(slot, state[name]), name


def test_bfloat16_close_to_transformers_bfloat16(make_checkpoint):
    """bf16 roundings differ between attention implementations; logits stay close."""
    from transformers import AutoModelForCausalLM

    path = make_checkpoint("llama")
    model, _ = load_model(path, dtype="bfloat16")
    assert model.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.bfloat16
    ids = list(range(3, 3 + PROMPT_LEN))
    got = PagedSession(model, block_size=16).step({0: ids})[0]
    assert got.dtype == torch.float32
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    expected = hf_logits(hf_model, ids)
    torch.testing.assert_close(got, expected, atol=0.1, rtol=0)
