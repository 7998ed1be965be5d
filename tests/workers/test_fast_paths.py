"""CPU fast paths of the model runner: dense decode rows vs the paged reference kernels,
the chunked argmax vs torch.argmax, the LM head's few-row matmul vs F.linear, and the
engine with dense rows under a tight budget."""

from __future__ import annotations

import random
import time

import pytest
import torch

from tandem.kernels import AttentionMetadata
from tandem.wire.engine_protocol import SamplingParams
from tandem.workers.config import EngineConfig
from tandem.workers.engine.llm import LLM
from tandem.workers.models.layers import SMALL_LOGITS_ROWS, lm_head_logits
from tandem.workers.runner import model_runner
from tandem.workers.runner.attention import SplitAttention, attention
from tandem.workers.runner.dense_decode import DenseDecodeKV
from tandem.workers.sampling.sampler import argmax_rows
from tests.workers.hf_checkpoints import load_hf_model
from tests.workers.test_engine import hf_greedy

NUM_LAYERS, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS = 2, 4, 2, 8, 4, 128


@pytest.mark.parametrize("vocab_size", [262, 4096, 4097, 32000, 32003])
def test_argmax_rows_equals_argmax_lowest_id_on_ties(vocab_size):
    g = torch.Generator().manual_seed(vocab_size)
    logits = torch.randn(5, vocab_size, generator=g)
    logits[0, vocab_size // 3] = logits[0, vocab_size // 2] = 50.0  # tie: lower id wins
    logits[1, -1] = 60.0  # max in the (short) tail chunk
    logits[2] = float("-inf")
    logits[2, 7] = 0.0
    logits[3] = 1.0  # all equal: id 0
    for rows in (logits, logits[1:4], logits[:, : vocab_size - 1]):
        assert torch.equal(argmax_rows(rows), rows.argmax(dim=-1))


@pytest.mark.parametrize("rows", [1, 2, 3, 5, SMALL_LOGITS_ROWS, SMALL_LOGITS_ROWS + 1, 33])
def test_lm_head_logits_equal_linear(rows):
    """The few-row path (W @ x.T, a verification at batch 1) gives F.linear's logits up to
    float32 rounding, contiguous, with the same argmax; other dtypes and layouts take
    F.linear itself."""
    g = torch.Generator().manual_seed(rows)
    weight = torch.randn(4099, 64, generator=g)
    hidden = torch.randn(rows, 64, generator=g)
    ref = torch.nn.functional.linear(hidden, weight)
    got = lm_head_logits(hidden, weight)
    assert got.shape == ref.shape and got.is_contiguous()
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-4)
    assert torch.equal(argmax_rows(got), argmax_rows(ref))
    h16, w16 = hidden.bfloat16(), weight.bfloat16()
    assert torch.equal(lm_head_logits(h16, w16), torch.nn.functional.linear(h16, w16))
    wt = weight.t().contiguous().t()  # not contiguous: F.linear
    assert torch.equal(lm_head_logits(hidden, wt), torch.nn.functional.linear(hidden, wt))


class _Sequences:
    """Random sequences over a shared paged cache: shuffled blocks, random K/V history."""

    def __init__(self, seed: int = 0) -> None:
        self.rng = random.Random(seed)
        self.gen = torch.Generator().manual_seed(seed)
        self.kv_cache = torch.zeros(NUM_BLOCKS, NUM_LAYERS, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
        self.free = list(range(NUM_BLOCKS))
        self.rng.shuffle(self.free)
        self.tables: dict[str, list[int]] = {}
        self.lens: dict[str, int] = {}

    def grow(self, seq: str, num_tokens: int) -> tuple[list[int], int]:
        table = self.tables.setdefault(seq, [])
        end = self.lens.get(seq, 0) + num_tokens
        while len(table) * BLOCK_SIZE < end:
            table.append(self.free.pop())
        self.lens[seq] = end
        return table, end

    def randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen)


def _run_step(
    seqs: _Sequences, dense: DenseDecodeKV, step: dict[str, int], verify: bool = False
) -> list[str]:
    """One step of ``{seq: num_new_tokens}`` through both paths; asserts equal outputs.
    ``verify``: queries of several tokens take dense rows too (speculative verification).

    Returns the sequences that took the dense path.
    """
    decodes, others = [], []
    tables, seq_lens, query_lens = {}, {}, {}
    for seq, n in step.items():
        start = seqs.lens.get(seq, 0)
        tables[seq], seq_lens[seq] = seqs.grow(seq, n)
        query_lens[seq] = n
        if n == 1:
            decodes.append((seq, start, tables[seq]))
        elif verify:
            decodes.append((seq, start, tables[seq], n))
        else:
            dense.release(seq)
            others.append(seq)
    chosen, dense_step = dense.prepare(decodes)
    order = [decodes[i][0] for i in chosen]
    order += [s for s in step if s not in order]
    num_tokens = sum(step.values())

    def meta_for(names):
        return AttentionMetadata.build(
            [tables[s] for s in names],
            [seq_lens[s] for s in names],
            [query_lens[s] for s in names],
            BLOCK_SIZE,
        )

    paged_meta = meta_for(order)
    split = None
    if dense_step is not None:
        rest = order[len(chosen) :]
        split = SplitAttention(
            paged_meta.slot_mapping, dense_step, meta_for(rest) if rest else None
        )
    for layer in range(NUM_LAYERS):
        q = seqs.randn(num_tokens, NUM_HEADS, HEAD_DIM)
        k = seqs.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM)
        v = seqs.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM)
        scale = HEAD_DIM**-0.5
        expected = attention(layer, q, k, v, seqs.kv_cache, paged_meta, scale)
        if split is not None:
            got = attention(layer, q, k, v, seqs.kv_cache, split, scale)
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    return order[: len(chosen)]


def test_dense_decode_equals_paged_attention_across_steps():
    seqs = _Sequences()
    dense = DenseDecodeKV(seqs.kv_cache, NUM_HEADS, max_bytes=1 << 30)
    # prefills only (nothing dense), then decodes of every length class
    assert _run_step(seqs, dense, {"a": 5, "b": 9, "c": 3}) == []
    assert _run_step(seqs, dense, {"a": 1, "b": 1, "c": 1}) == ["a", "b", "c"]  # rows 0, 1, 2
    assert dense.capacity == 128
    # b idle this step (rows 0 and 2 only: not the identity layout), d prefilling meanwhile
    assert _run_step(seqs, dense, {"c": 1, "d": 7, "a": 1}) == ["a", "c"]
    # b finishes; d's first decode takes b's row (filled from the paged cache)
    dense.release("b")
    assert _run_step(seqs, dense, {"d": 1, "a": 1, "c": 1}) == ["a", "d", "c"]
    assert dense.row_of == {"a": 0, "d": 1, "c": 2}
    # a decode whose context was prefilled in this very step by another request is not
    # possible here, but a chunk scheduled for a dense request drops its row
    assert _run_step(seqs, dense, {"a": 2, "c": 1}) == ["c"]
    assert "a" not in dense.row_of
    # long context: capacity grows (rows keep their contents)
    _run_step(seqs, dense, {"e": 120})
    for _ in range(10):
        assert _run_step(seqs, dense, {"e": 1, "c": 1, "d": 1}) == ["e", "d", "c"]
    assert dense.capacity == 256
    for seq in ("c", "d", "e"):
        dense.release(seq)
    # idle: the copy keeps its size for idle_release_s (a growth costs a whole copy),
    # then is freed, and rebuilt on demand
    assert (dense.num_rows, dense.capacity) == (8, 256)
    now_s = time.monotonic()
    assert not dense.release_if_idle(now_s)
    assert _run_step(seqs, dense, {"d": 1, "c": 1}) == ["d", "c"]  # rows reused, no growth
    assert (dense.num_rows, dense.capacity) == (8, 256)
    assert not dense.release_if_idle(now_s + 2 * dense.idle_release_s)  # rows in use
    dense.release("c")
    dense.release("d")
    assert not dense.release_if_idle(time.monotonic() + 0.5 * dense.idle_release_s)
    assert dense.release_if_idle(time.monotonic() + dense.idle_release_s)
    assert (dense.num_rows, dense.capacity) == (0, 0)
    assert _run_step(seqs, dense, {"d": 1, "c": 1}) == ["d", "c"]


def test_dense_decode_budget_sends_the_rest_to_the_paged_path():
    seqs = _Sequences(seed=1)
    bytes_per_row = 128 * NUM_LAYERS * 2 * NUM_KV_HEADS * HEAD_DIM * 4
    dense = DenseDecodeKV(seqs.kv_cache, NUM_HEADS, max_bytes=2 * bytes_per_row)
    _run_step(seqs, dense, {"a": 6, "b": 2, "c": 11})
    assert _run_step(seqs, dense, {"a": 1, "b": 1, "c": 1}) == ["a", "b"]
    dense.release("a")
    assert _run_step(seqs, dense, {"c": 1, "b": 1}) == ["c", "b"]  # c now fits, in row 0
    # too long for the budget's capacity: every request falls back, rows are dropped
    _run_step(seqs, dense, {"d": 140})
    assert _run_step(seqs, dense, {"d": 1}) == []
    assert dense.capacity == 128


def test_engine_with_a_two_row_budget_equals_transformers(make_checkpoint, monkeypatch):
    path = make_checkpoint("llama")  # 2 layers, 2 KV heads, head_dim 16
    bytes_per_row = 128 * 2 * 2 * 2 * 16 * 4  # capacity 128: positions, layers, K/V, heads, dim
    monkeypatch.setattr(model_runner, "DEFAULT_DENSE_DECODE_BYTES", 2 * bytes_per_row)
    llm = LLM(EngineConfig.from_flat(model=path, block_size=8, num_kv_blocks=96))
    dense = llm.engine.runner.dense
    num_dense, num_decodes = [], []
    prepare = dense.prepare

    def spy(decodes):
        chosen, step = prepare(decodes)
        num_dense.append(len(chosen))
        num_decodes.append(len(decodes))
        return chosen, step

    monkeypatch.setattr(dense, "prepare", spy)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (1, 9, 30, 17)]
    sp = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    results = llm.generate(prompt_token_ids=prompts, sampling_params=sp)
    hf = load_hf_model(path)
    for prompt, r in zip(prompts, results):
        assert r.token_ids == hf_greedy(hf, prompt, 10)
    assert max(num_dense) == 2 and max(num_decodes) == 4  # two dense, two paged decodes
    assert dense.row_of == {} and dense.num_rows > 0  # every row released at finish
    dense.idle_release_s = 0.0
    llm.engine.runner.release_idle_memory()  # what the engine loop does while idle
    assert dense.num_rows == 0 and dense.capacity == 0
    llm.engine.check_integrity()


def test_dense_rows_with_verification_queries_equal_paged_attention():
    """Rows verifying drafts (several query tokens, each slot masked at its own position)
    beside one-token rows, and a step where every row verifies: the paged kernels' output."""
    seqs = _Sequences(seed=3)
    dense = DenseDecodeKV(seqs.kv_cache, NUM_HEADS, max_bytes=1 << 30)
    _run_step(seqs, dense, {"a": 6, "b": 9, "c": 4, "d": 11})
    assert _run_step(seqs, dense, {"a": 1, "b": 1, "c": 1, "d": 1}) == ["a", "b", "c", "d"]
    mixed = _run_step(seqs, dense, {"a": 1, "b": 4, "c": 1, "d": 3}, verify=True)
    assert mixed == ["a", "b", "c", "d"]
    assert _run_step(seqs, dense, {"b": 2, "d": 5}, verify=True) == ["b", "d"]
    assert _run_step(seqs, dense, {"c": 3, "a": 1, "d": 1}, verify=True) == ["a", "c", "d"]
