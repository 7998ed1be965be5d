"""Decode CUDA graphs without CUDA: buckets, the flags, static buffer filling and padding, and
the graph runner replaying through ``EagerBackend`` (the same static buffers and per-bucket
metadata a CUDA graph reads) with every kernel in Triton under the interpreter: tokens equal
the eager path's, prefills and oversize batches fall back to eager, and a replayed decode step
reads the device exactly once (the sampled tokens). The capture itself needs a GPU
(tests/gpu/)."""

from __future__ import annotations

import argparse
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of the Triton kernels

import msgspec  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402

from tandem.kernels import AttentionMetadata  # noqa: E402
from tandem.wire.engine_protocol import SamplingParams  # noqa: E402
from tandem.workers.config import EngineConfig, add_engine_arguments, engine_overrides  # noqa: E402
from tandem.workers.engine.llm import LLM  # noqa: E402
from tandem.workers.graphs.build import build_step_graphs  # noqa: E402
from tandem.workers.graphs.runner import DecodeGraphRunner, EagerBackend  # noqa: E402
from tandem.workers.graphs.sizes import bucket_for, capture_sizes, parse_cuda_graph_sizes  # noqa: E402
from tandem.workers.graphs.static_inputs import StaticDecodeInputs  # noqa: E402
from tests.workers import hf_checkpoints  # noqa: E402


def test_default_buckets_follow_vllm_and_end_at_max_num_seqs():
    assert capture_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    assert capture_sizes(256) == [1, 2, 4, 8, *range(16, 257, 16)]
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(1) == [1]
    assert capture_sizes(64, [8, 1, 8, 3]) == [1, 3, 8]


@pytest.mark.parametrize(
    "num_seqs,bucket", [(1, 1), (3, 4), (5, 8), (16, 16), (17, 32), (33, 40), (40, 40)]
)
def test_bucket_is_the_smallest_captured_size_that_fits(num_seqs, bucket):
    assert bucket_for(num_seqs, capture_sizes(40)) == bucket


def test_no_bucket_means_eager():
    assert bucket_for(41, capture_sizes(40)) is None
    assert bucket_for(0, capture_sizes(40)) is None
    assert bucket_for(9, [1, 2, 4, 8]) is None


def test_bad_sizes_name_the_field():
    for sizes, max_num_seqs in (([0, 2], 8), ([16], 8), ([], 8)):
        with pytest.raises(ValueError, match="cuda_graph_sizes"):
            EngineConfig.from_flat(max_num_seqs=max_num_seqs, cuda_graph_sizes=sizes)
    for text in ("1,two", "", " , "):
        with pytest.raises(ValueError, match="cuda_graph_sizes"):
            parse_cuda_graph_sizes(text)
    assert parse_cuda_graph_sizes("1,2, 4 8") == [1, 2, 4, 8]


def test_flags_reach_the_config_and_pool_overrides():
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    add_engine_arguments(parser, prefix="decode-")
    args = parser.parse_args(["--cuda-graph-sizes", "1,2,4", "--decode-enforce-eager"])
    assert engine_overrides(args) == {"cuda_graph_sizes": [1, 2, 4]}
    assert engine_overrides(args, prefix="decode-") == {"enforce_eager": True}
    config = EngineConfig.from_flat(max_num_seqs=4, **engine_overrides(args))
    assert config.graphs.cuda_graph_sizes == [1, 2, 4] and not config.graphs.enforce_eager
    with pytest.raises(SystemExit):
        parser.parse_args(["--cuda-graph-sizes", "x"])


def test_cpu_engine_builds_no_graphs():
    model = torch.nn.Linear(1, 1)
    kv_cache = torch.zeros(4, 1, 2, 4, 1, 8)
    graphs = build_step_graphs(EngineConfig.from_flat(), model, kv_cache, 64)
    assert graphs.decode is None and graphs.piecewise is None


def test_captures_use_a_capture_mode_this_torch_accepts():
    """Captures run in "thread_local" mode (runner.CAPTURE_ERROR_MODE: other threads' CUDA
    work must not invalidate them); torch.cuda.graph must take the argument and the value."""
    import inspect

    from tandem.workers.graphs.runner import CAPTURE_ERROR_MODE

    assert CAPTURE_ERROR_MODE == "thread_local"
    params = inspect.signature(torch.cuda.graph.__init__).parameters
    assert "capture_error_mode" in params
    assert CAPTURE_ERROR_MODE in (torch.cuda.graph.__init__.__doc__ or torch.cuda.graph.__doc__)


def test_fill_writes_the_batch_and_pads_to_the_bucket():
    inputs = StaticDecodeInputs(max_batch=8, max_blocks_per_seq=4, block_size=4, device="cpu")
    tables = [[7, 2], [5], [1, 3, 6]]
    seq_lens = [6, 3, 9]
    positions = [n - 1 for n in seq_lens]
    inputs.fill([11, 12, 13], positions, tables, seq_lens, batch=4)
    assert inputs.device_view("input_ids", 4).tolist() == [11, 12, 13, 0]
    assert inputs.device_view("positions", 4).tolist() == [5, 2, 8, 0]
    assert inputs.device_view("seq_lens", 4).tolist() == [6, 3, 9, 1]
    assert inputs.device_view("query_start_loc", 4).tolist() == [0, 1, 2, 3, 4]
    # slot = block of the position * block_size + offset; padding is -1 (no KV write)
    assert inputs.device_view("slot_mapping", 4).tolist() == [2 * 4 + 1, 5 * 4 + 2, 6 * 4 + 0, -1]
    assert inputs.block_tables(4).tolist() == [[7, 2, 0, 0], [5, 0, 0, 0], [1, 3, 6, 0], [0] * 4]
    expected = AttentionMetadata.build(tables, seq_lens, [1, 1, 1], 4)
    assert inputs.device_view("slot_mapping", 3).tolist() == expected.slot_mapping.tolist()
    # only the header and the rows x columns the step uses: 4 rows x 3 blocks, not 4 x 4
    assert inputs.num_copied_bytes == (5 * 8 + 1 + 4 * 3) * 4

    # a smaller batch next: the used corner is rewritten (padding rows zeroed), the columns
    # past it keep stale ids no kernel reads (each row is read up to its seq_len's block)
    inputs.fill([21], [0], [[4]], [1], batch=2)
    assert inputs.device_view("input_ids", 2).tolist() == [21, 0]
    assert inputs.device_view("slot_mapping", 2).tolist() == [16, -1]
    assert inputs.block_tables(2)[:, :1].tolist() == [[4], [0]]
    assert inputs.block_tables(2).tolist() == [[4, 2, 0, 0], [0, 0, 0, 0]]  # stale: 2
    assert inputs.num_copied_bytes == (5 * 8 + 1 + 2 * 1) * 4
    meta = inputs.metadata(2)
    assert meta.max_query_len == 1 and meta.block_tables.shape == (2, 4)
    assert meta.seq_lens.data_ptr() == inputs.device_view("seq_lens", 2).data_ptr()


@pytest.mark.parametrize("triton", [True, False], ids=["triton", "reference"])
def test_stale_table_columns_past_a_rows_blocks_are_never_read(triton, monkeypatch):
    """fill copies only the step's corner of the block table; both attention paths must
    read nothing past a row's ceil(seq_len / block_size) blocks, padded rows included:
    the stale columns are poisoned with an out-of-range block id."""
    from tandem.kernels import paged_attention
    from tandem.workers.runner.kv_cache import allocate_kv_cache

    monkeypatch.setenv("TANDEM_FORCE_TRITON", "1" if triton else "0")
    torch.manual_seed(0)
    block_size, heads, head_dim = 4, 2, 8
    kv = allocate_kv_cache(16, 1, block_size, heads, head_dim, torch.float32, torch.device("cpu"))
    kv.copy_(torch.randn_like(kv))
    inputs = StaticDecodeInputs(max_batch=4, max_blocks_per_seq=6, block_size=block_size,
                                device="cpu")  # fmt: skip
    inputs.fill([1] * 4, [20] * 4, [[1, 2, 3, 4, 5, 6]] * 4, [21] * 4, batch=4)  # long step
    tables, seq_lens = [[7, 2], [5]], [6, 3]
    inputs.fill([1, 2], [5, 2], tables, seq_lens, batch=4)  # short step: 2 real + 2 padded rows
    inputs.block_tables(4)[:, 2:] = 10**6  # past every row's used columns
    query = torch.randn(4, heads, head_dim)
    expected = paged_attention(
        query[:2], kv[:, 0], AttentionMetadata.build(tables, seq_lens, [1, 1], block_size), 0.3
    )
    meta = inputs.metadata(4)
    if not triton:  # the reference reads the host lists: give it the step's real ones
        meta.seq_lens_list, meta.max_seq_len = [6, 3, 1, 1], 6
    out = paged_attention(query, kv[:, 0], meta, 0.3)
    torch.testing.assert_close(out[:2], expected)
    assert torch.isfinite(out).all()  # padded rows read block 0


def test_fill_rejects_what_the_buffers_cannot_hold():
    inputs = StaticDecodeInputs(max_batch=4, max_blocks_per_seq=2, block_size=4, device="cpu")
    with pytest.raises(ValueError, match="block table"):
        inputs.fill([1], [8], [[1, 2, 3]], [9], batch=1)
    with pytest.raises(ValueError, match="batch"):
        inputs.fill([1, 2], [0, 0], [[1], [2]], [1, 1], batch=1)
    with pytest.raises(ValueError, match="batch"):
        inputs.fill([1], [0], [[1]], [1], batch=5)


PROMPTS = [[5, 9, 2, 7, 1], [3] * 9, [8, 4], [6, 6, 1]]


def _llm(path: str, max_num_seqs: int = 4) -> LLM:
    config = EngineConfig.from_flat(
        model=path,
        block_size=4,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=16,
        num_kv_blocks=32,
        dense_decode_bytes=0,  # the paged kernels, as on CUDA
    )
    return LLM(config)


def _with_graphs(llm: LLM, sizes: list[int]) -> DecodeGraphRunner:
    engine = llm.engine
    graphs = DecodeGraphRunner(
        engine.model, engine.kv_cache, 4, engine.max_model_len, sizes, EagerBackend()
    )
    graphs.capture()
    engine.runner.graphs = graphs
    return graphs


@pytest.fixture(scope="module")
def one_layer_llama(tmp_path_factory) -> str:
    return hf_checkpoints.make_checkpoint(
        "llama", tmp_path_factory.mktemp("ckpt-llama"), num_hidden_layers=1
    )


@pytest.fixture
def triton_checkpoint(one_layer_llama, monkeypatch):
    monkeypatch.setenv("TANDEM_FORCE_TRITON", "1")
    return one_layer_llama


def test_replay_path_gives_the_eager_tokens_and_falls_back_for_prefills(triton_checkpoint):
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    eager = _llm(triton_checkpoint).generate(prompt_token_ids=PROMPTS, sampling_params=params)

    llm = _llm(triton_checkpoint)
    graphs = _with_graphs(llm, [1, 2, 4])
    replayed = llm.generate(prompt_token_ids=PROMPTS, sampling_params=params)
    assert [r.token_ids for r in replayed] == [r.token_ids for r in eager]
    # budget 16: step 1 prefills r0-r2 (16 tokens), step 2 = r3's prefill + 3 decodes (mixed:
    # eager), steps 3-4 decode all 4 (bucket 4), step 5 decodes r3 alone (bucket 1)
    assert graphs.num_replays == {1: 1, 2: 0, 4: 2}
    llm.engine.check_integrity()

    # three decodes but graphs only up to 2: the step runs eager, same tokens
    llm = _llm(triton_checkpoint)
    graphs = _with_graphs(llm, [1, 2])
    small = llm.generate(prompt_token_ids=PROMPTS[:3], sampling_params=params)
    assert [r.token_ids for r in small] == [r.token_ids for r in eager[:3]]
    assert graphs.num_replays == {1: 0, 2: 0}
    llm.engine.check_integrity()


# Tensor reads that wait for the device on CUDA (D2H), and tensors built from Python lists
# (a pageable H2D copy when a device is given).
_HOST_READS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy"}


class _CountHostReads(TorchFunctionMode):
    """Counts host reads and list->tensor builds by Tandem code (the Triton interpreter's own
    copies between torch and NumPy are not the engine's and are skipped)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []
        self.tensors_from_lists: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in _HOST_READS or name == "tensor":
            caller = sys._getframe(1)
            where = f"{os.path.basename(caller.f_code.co_filename)}:{caller.f_lineno}"
            if f"{os.sep}triton{os.sep}" not in caller.f_code.co_filename:
                (self.reads if name != "tensor" else self.tensors_from_lists).append(
                    f"{name} at {where}"
                )
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("logprobs", [None, 3], ids=["greedy", "logprobs"])
def test_replayed_decode_step_reads_the_device_once(triton_checkpoint, logprobs):
    llm = _llm(triton_checkpoint)
    graphs = _with_graphs(llm, [1, 2, 4])
    engine = llm.engine
    from tandem.wire.engine_protocol import EngineRequest

    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS[:3]):
        row_params = params  # greedy: none asks; else r1 the sampled token's alone, r0 r2 top 3
        if logprobs is not None:
            row_params = msgspec.structs.replace(params, logprobs=0 if i == 1 else logprobs)
        assert engine.add_request(EngineRequest(f"r{i}", prompt, row_params)) is None
    while sum(graphs.num_replays.values()) == 0:  # prefill steps, eager
        engine.step()
    before = dict(graphs.num_replays)
    with _CountHostReads() as counter:
        out = engine.step()  # a decode step of 3: bucket 4
    assert graphs.num_replays[4] == before[4] + 1
    # the one read: the step's sampled tokens (workers/runner/async_step.py, StepResult.token_list);
    # with logprobs, the packed table copied with them (to pinned memory on CUDA, before the
    # step's one event wait: workers/sampling/sample_logprobs.py) is read from the host
    assert counter.reads[0].startswith("tolist at async_step.py"), counter.reads
    if logprobs is None:
        assert len(counter.reads) == 1, counter.reads
        assert counter.tensors_from_lists == [], counter.tensors_from_lists
    else:
        assert len(counter.reads) == 2, counter.reads
        assert counter.reads[1].startswith("tolist at sample_logprobs.py"), counter.reads
        # index tensors: through pinned memory (kernels/metadata.py list_to_device)
        assert all("metadata.py" in c for c in counter.tensors_from_lists), counter
        by_id = {o.request_id: o for o in out.outputs}
        assert len(by_id["r0"].new_logprobs[0].top_token_ids) == logprobs
        assert by_id["r1"].new_logprobs[0].top_token_ids == []  # logprobs=0: the sampled one only
    while engine.has_work():
        engine.step()
    engine.check_integrity()
