"""Write small GGUF files from HF checkpoints, as llama.cpp's converter lays them out.

    write_gguf_from_hf(hf_dir, out_path, "Q4_0")

2-D weights are stored in the requested type (quantized with ``gguf.quants``,
or, for types it cannot quantize, ``random_bytes=True`` fills the blocks
with seeded random bytes: a valid encoding whose values are whatever they
decode to); 1-D tensors stay F32. Llama q/k rows are interleaved per head
as llama.cpp does for its rope kernel. The tokenizer is a byte-level BPE
of the 256 byte symbols, one merge ("h e") and BOS/EOS/PAD at the end.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

NUM_SPECIAL = 3  # <s>, </s>, <pad> at the end of the vocabulary

_BLOCK_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_GLOBAL_NAMES = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
}


def gguf_name(hf_name: str) -> str:
    stem, _, suffix = hf_name.rpartition(".")
    if stem.startswith("model.layers."):
        _, _, idx, part = stem.split(".", 3)
        return f"blk.{idx}.{_BLOCK_NAMES[part]}.{suffix}"
    return f"{_GLOBAL_NAMES[stem]}.{suffix}"


def _interleave_rope_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    # HF [h][2][half] -> llama.cpp [h][half][2]
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf_from_hf(
    hf_dir: str, out_path: str | Path, qtype: str, *, random_bytes: bool = False, seed: int = 0
) -> None:
    import gguf
    from safetensors.torch import load_file

    from tandem.workers.checkpoints.tiny import _byte_to_char

    cfg = json.loads((Path(hf_dir) / "config.json").read_text())
    arch = cfg["model_type"]
    num_heads, num_kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
    w = gguf.GGUFWriter(str(out_path), arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(num_heads)
    w.add_head_count_kv(num_kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(float(cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    chars = _byte_to_char()
    num_plain = cfg["vocab_size"] - NUM_SPECIAL
    tokens = [chars[b] for b in range(256)] + ["he"]
    tokens += [f"<unused{i}>" for i in range(num_plain - len(tokens))] + ["<s>", "</s>", "<pad>"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([1] * num_plain + [3] * NUM_SPECIAL)
    w.add_token_merges(["h e"])
    w.add_bos_token_id(num_plain)
    w.add_eos_token_id(num_plain + 1)
    w.add_pad_token_id(num_plain + 2)
    w.add_add_bos_token(False)
    rng = np.random.default_rng(seed)
    quant = gguf.GGMLQuantizationType[qtype]
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[quant]
    for name, tensor in sorted(load_file(str(Path(hf_dir) / "model.safetensors")).items()):
        if cfg.get("tie_word_embeddings") and name == "lm_head.weight":
            continue
        data = tensor.to(torch.float32).numpy()
        if arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            data = _interleave_rope_rows(data, num_heads)
        elif arch == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            data = _interleave_rope_rows(data, num_kv_heads)
        if data.ndim == 1 or qtype == "F32":
            w.add_tensor(gguf_name(name), np.ascontiguousarray(data, dtype=np.float32))
        elif random_bytes:
            rows, cols = data.shape
            raw = rng.integers(0, 256, (rows, cols // block_elems * block_bytes), dtype=np.uint8)
            w.add_tensor(gguf_name(name), raw, raw_dtype=quant)
        else:
            w.add_tensor(gguf_name(name), gguf.quants.quantize(data, quant), raw_dtype=quant)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
