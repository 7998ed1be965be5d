"""Verification graphs without CUDA (issue #26: drafts verified inside the decode graphs, the
buckets counting tokens): the token buckets, the static buffers of a multi-token batch (query
starts, slots, padding), the Triton kernel over a bucket's metadata equal to the step's own,
and a speculative engine whose drafted steps replay verification graphs through
``EagerBackend`` with every kernel in Triton under the interpreter: tokens identical to the
plain engine's, with drafts accepted and rejected. The capture itself needs a GPU
(tests/gpu/test_cuda_spec_decode.py)."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of the Triton kernels

import pytest  # noqa: E402
import torch  # noqa: E402

from tandem.kernels import AttentionMetadata, paged_attention  # noqa: E402
from tandem.wire.engine_protocol import EngineRequest  # noqa: E402
from tandem.workers.config import EngineConfig  # noqa: E402
from tandem.workers.engine.core import EngineCore  # noqa: E402
from tandem.workers.graphs.build import make_step_graphs  # noqa: E402
from tandem.workers.graphs.runner import EagerBackend  # noqa: E402
from tandem.workers.graphs.static_inputs import StaticDecodeInputs  # noqa: E402
from tandem.workers.graphs.verify import VerifyGraphRunner, verify_sizes  # noqa: E402
from tandem.workers.runner.kv_cache import allocate_kv_cache  # noqa: E402
from tests.workers.test_spec_decode import (  # noqa: E402
    NGRAM,
    OracleProposer,
    expected_by_prompt,
    greedy,
    prompts,
)

pytestmark = pytest.mark.long  # tens of seconds: started early (tests/conftest.py)


def test_token_buckets_are_the_decode_buckets_and_those_times_q():
    assert verify_sizes([1, 2, 4, 8], 5) == [1, 2, 4, 5, 8, 10, 20, 40]
    assert verify_sizes([1, 2, 3], 2) == [1, 2, 3, 4, 6]
    with pytest.raises(ValueError, match="2 tokens"):
        VerifyGraphRunner(None, torch.zeros(1, 1, 2, 4, 1, 8), 4, 64, [1, 2], 1, EagerBackend())


def test_fill_queries_lays_out_tokens_and_pads_sequences_and_tokens():
    inputs = StaticDecodeInputs(max_batch=4, max_blocks_per_seq=4, block_size=4, device="cpu",
                                max_tokens=12)  # fmt: skip
    tables = [[7, 2], [5], [1, 3, 6]]
    seq_lens = [7, 3, 12]
    query_lens = [3, 1, 4]  # r0: a token + 2 drafts, r1: plain, r2: a token + 3 drafts
    positions = [4, 5, 6, 2, 8, 9, 10, 11]
    ids = [11, 12, 13, 21, 31, 32, 33, 34]
    inputs.fill_queries(ids, positions, tables, seq_lens, query_lens, seqs=4, tokens=10)
    assert inputs.device_view("input_ids", 10).tolist() == ids + [0, 0]
    assert inputs.device_view("positions", 10).tolist() == positions + [0, 0]
    assert inputs.device_view("seq_lens", 4).tolist() == [7, 3, 12, 1]
    # the padding sequence has no query token: the kernel skips it
    assert inputs.device_view("query_start_loc", 4).tolist() == [0, 3, 4, 8, 8]
    expected = AttentionMetadata.build(tables, seq_lens, query_lens, 4)
    slots = inputs.device_view("slot_mapping", 10).tolist()
    assert slots == expected.slot_mapping.tolist() + [-1, -1]  # padding tokens: no KV write
    assert inputs.block_tables(4).tolist() == [[7, 2, 0, 0], [5, 0, 0, 0], [1, 3, 6, 0], [0] * 4]
    meta = inputs.query_metadata(4, 10, 5)
    assert meta.max_query_len == 5 and meta.num_query_tokens == 10
    assert meta.slot_mapping.data_ptr() == inputs.device_view("slot_mapping", 10).data_ptr()
    with pytest.raises(ValueError, match="add up"):
        inputs.fill_queries(ids, positions, tables, seq_lens, [3, 1, 3], seqs=4, tokens=10)
    with pytest.raises(ValueError, match="do not fit"):
        inputs.fill_queries(ids, positions, tables, seq_lens, query_lens, seqs=4, tokens=6)
    with pytest.raises(ValueError, match="does not fit"):
        inputs.query_metadata(8, 10, 5)


def test_triton_kernel_over_a_bucket_equals_the_steps_own_metadata(monkeypatch):
    monkeypatch.setenv("TANDEM_FORCE_TRITON", "1")
    torch.manual_seed(0)
    block_size, heads, head_dim = 4, 2, 8
    kv = allocate_kv_cache(16, 1, block_size, heads, head_dim, torch.float32, torch.device("cpu"))
    kv.copy_(torch.randn_like(kv))
    inputs = StaticDecodeInputs(max_batch=4, max_blocks_per_seq=4, block_size=block_size,
                                device="cpu", max_tokens=12)  # fmt: skip
    tables, seq_lens, query_lens = [[7, 2], [5], [1, 3, 6]], [7, 3, 12], [3, 1, 4]
    positions = [4, 5, 6, 2, 8, 9, 10, 11]
    inputs.fill_queries([1] * 8, positions, tables, seq_lens, query_lens, seqs=4, tokens=12)
    query = torch.randn(12, heads, head_dim)
    expected = paged_attention(
        query[:8], kv[:, 0], AttentionMetadata.build(tables, seq_lens, query_lens, block_size), 0.3
    )
    out = paged_attention(query, kv[:, 0], inputs.query_metadata(4, 12, 5), 0.3)
    torch.testing.assert_close(out[:8], expected)


def _engine(spec: dict | None, graphs: bool) -> EngineCore:
    config = EngineConfig.from_flat(
        model="tiny",
        block_size=8,
        num_kv_blocks=64,
        max_num_batched_tokens=32,
        max_num_seqs=4,
        dense_decode_bytes=0,  # the paged kernels, as on CUDA
        speculative_config=spec,
        cuda_graph_mode="decode",
    )
    engine = EngineCore(config)
    if graphs:  # what build_step_graphs captures on CUDA, over EagerBackend
        runner = engine.runner
        made = make_step_graphs(
            config, runner.model, runner.kv_cache, engine.max_model_len, EagerBackend()
        )
        made.capture(log=False)
        runner.graphs = made.decode
        if runner.drafter is not None:  # build_draft_graphs
            drafter = runner.drafter
            made = make_step_graphs(
                config, drafter.model, drafter.kv_cache, engine.max_model_len, EagerBackend(),
                full_only=True,
            )  # fmt: skip
            assert made.piecewise is None
            drafter.graphs = made.decode.capture(log=False) and made.decode
    return engine


def _generate(engine: EngineCore, requests) -> list[list[int]]:
    tokens: dict[str, list[int]] = {}
    for i, (prompt, sp) in enumerate(requests):
        assert engine.add_request(EngineRequest(f"r{i}", prompt, sp)) is None
        tokens[f"r{i}"] = []
    while engine.has_work():
        for o in engine.step().outputs:
            assert o.error is None, o.error
            tokens[o.request_id].extend(o.new_token_ids)
    engine.check_integrity()
    return [tokens[f"r{i}"] for i in range(len(requests))]


def test_drafted_steps_replay_verification_graphs_with_the_plain_tokens(monkeypatch):
    monkeypatch.setenv("TANDEM_FORCE_TRITON", "1")
    requests = [(p, greedy(16)) for p in prompts()[:2]]
    plain = _generate(_engine(None, graphs=False), requests)

    engine = _engine(NGRAM, graphs=True)
    graphs = engine.runner.graphs
    assert graphs.verify is not None and graphs.verify.query_tokens == 5
    engine.scheduler.spec.proposer = OracleProposer(
        expected_by_prompt([(p, sp, 1) for p, sp in requests], [[o] for o in plain])
    )
    spec = _generate(engine, requests)
    assert spec == plain
    stats = engine.scheduler.spec.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # accepted and rejected
    assert sum(graphs.verify.num_replays.values()) > 0  # drafted steps: verification graphs
    assert sum(graphs.num_replays.values()) + sum(graphs.verify.num_replays.values()) > 0


def test_a_draft_models_forwards_replay_its_own_graphs(monkeypatch):
    monkeypatch.setenv("TANDEM_FORCE_TRITON", "1")
    requests = [(p, greedy(8)) for p in prompts()[1:2]]
    plain = _generate(_engine(None, graphs=False), requests)
    draft = {"method": "draft_model", "model": "tiny", "num_speculative_tokens": 3}
    engine = _engine(draft, graphs=True)
    spec = _generate(engine, requests)
    assert spec == plain
    stats = engine.scheduler.spec.stats
    assert stats.num_accepted_tokens / stats.num_draft_tokens > 0.95  # tiny drafts for itself
    drafter = engine.runner.drafter
    assert sum(drafter.graphs.num_replays.values()) > 0  # proposal forwards: decode graphs
    assert sum(engine.runner.graphs.verify.num_replays.values()) > 0
