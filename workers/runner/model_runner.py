"""Model runner: SchedulerOutput in, sampled tokens out.

It keeps its own copy of each request's tokens and block table, updated from
the scheduler's diffs, and flattens a step into one batch:

    requests     a (prefill chunk 3)   b (decode)   c (decode)
    input_ids    [a5 a6 a7]            [b9]         [c4]
    positions    [5 6 7]               [9]          [4]
    seq_lens     8                     10           5
    logits rows  a7 (if the chunk ends the prompt), b9, c4

On CPU (fp32), single-token queries and verifications of drafts that get a dense decode
row (``workers/runner/dense_decode.py``) come first, ordered by row, and the step's
metadata is a ``workers.runner.attention.SplitAttention``; the rest keep the order
above and go through the paged kernels.

A step is launched then finished (``launch`` / ``finish``): the loop thread
plans it (``workers/runner/step_batch.py``), the step stream runs its forward and
sampling, and ``finish`` reads the sampled tokens. The synchronous loop
(``execute``) finishes each step at once; the overlapped loop
(``workers/runner/async_step.py``) plans and launches the next step first.

The class keeps the step's entry points and its output; the host half (request copies,
planning) is ``workers/runner/step_planning.py``, the device half (layout, forward,
sampling, verification) ``workers/runner/step_forward.py``.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from tandem.kernels.prefill_attention import use_sdpa_prefills
from tandem.scheduler.messages import KVConnectorOutput, ModelRunnerOutput, SchedulerOutput
from tandem.wire.config_fields import default_of
from tandem.workers.config.sections import GraphsConfig
from tandem.workers.graphs.piecewise import PiecewiseGraphRunner
from tandem.workers.graphs.runner import DecodeGraphRunner
from tandem.workers.runner.async_step import StepHandle, StepResult, StepStream
from tandem.workers.runner.cpu_allocator import tune_malloc_for_inference
from tandem.workers.runner.dense_decode import DenseDecodeKV
from tandem.workers.runner.spec_step import apply_result
from tandem.workers.runner.step_batch import StepPlan
from tandem.workers.runner.step_forward import StepForward
from tandem.workers.runner.step_planning import ReqState, StepPlanning
from tandem.workers.sampling.sampler import Sampler
from tandem.workers.sampling.state import SamplingExtras

# CPU only: bytes the dense decode copy of the KV may use (see workers/runner/dense_decode.py).
DEFAULT_DENSE_DECODE_BYTES = 1 << 30


class ModelRunner(StepPlanning, StepForward):
    def __init__(
        self,
        model: torch.nn.Module,
        kv_cache: torch.Tensor,
        block_size: int,
        eos_token_id: int | None,
        *,
        connector: Any = None,  # kvtransfer.base.KVConnectorWorkerSide
        seed: int | None = 0,
        dense_decode_bytes: int | None = None,
        decode_graphs: DecodeGraphRunner | None = None,
        piecewise_graphs: PiecewiseGraphRunner | None = None,
        prefill_attention: str = default_of(GraphsConfig, "prefill_attention"),
        overlap: bool = False,
        drafter: Any = None,  # workers.spec.draft_model.DraftModel
    ) -> None:
        self.model = model
        # each step's device work: on a thread of its own when steps overlap on
        # CPU, else inline (workers/runner/async_step.py)
        self.stream = StepStream(threaded=overlap and kv_cache.device.type == "cpu")
        self.graphs = decode_graphs  # CUDA: decode-only steps replay a captured graph
        self.piecewise = piecewise_graphs  # CUDA: other steps replay pieces around attention
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = kv_cache.device
        self.eos_token_id = eos_token_id
        self.connector = connector
        self.sampler = Sampler(seed)
        # prefix-free prefills through SDPA on their own K/V (kernels/prefill_attention.py)
        self.sdpa_prefills = use_sdpa_prefills(prefill_attention, self.device, kv_cache.dtype)
        self.requests: dict[str, ReqState] = {}
        # speculative decoding with a draft model: fills the steps' MODEL_DRAFT slots
        self.drafter = drafter
        # penalties / logit bias / bad words of the requests that use them
        self.extras = SamplingExtras(model.vocab_size, self.device)
        if self.device.type == "cpu":
            tune_malloc_for_inference()
        # Dense decode rows: a CPU fast path (the Triton kernels read the paged cache directly).
        # fp32 only: its softmax runs in the cache dtype, unlike SDPA's fp32 accumulation.
        if dense_decode_bytes is None:
            on_cpu_fp32 = self.device.type == "cpu" and kv_cache.dtype == torch.float32
            dense_decode_bytes = DEFAULT_DENSE_DECODE_BYTES if on_cpu_fp32 else 0
        self.dense = None
        if dense_decode_bytes > 0:
            num_heads = model.config.num_attention_heads
            self.dense = DenseDecodeKV(kv_cache, num_heads, dense_decode_bytes)
        if connector is not None:
            connector.register_kv_caches(kv_cache)

    def close(self) -> None:
        self.stream.close()

    def release_idle_memory(self) -> None:
        """Called by the engine loop while it has nothing to run."""
        if self.dense is not None:
            self.dense.release_if_idle(time.monotonic())
        if self.drafter is not None:
            self.drafter.release_if_idle(time.monotonic())

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step and wait for it (the synchronous loop)."""
        return self.finish(self.launch(so))

    def launch(self, so: SchedulerOutput, prev: StepHandle | None = None) -> StepHandle:
        """Plan ``so`` on this (the loop) thread and start its device work on the step
        stream (``workers/runner/async_step.py``); return without waiting for it. ``prev``: the
        step launched before, still in flight (its sampled tokens feed this one). Every
        launched step must be passed to ``finish``, in launch order."""
        plan = StepPlan()
        self._update_states(so, plan)
        if prev is not None and self._needs_host_tokens(so):
            self.read_tokens(prev)  # penalties / bad words count the tokens on the host
        meta = so.kv_connector_metadata
        if self.connector is not None and meta is not None:
            if prev is not None and getattr(meta, "loads", True):
                self.read_tokens(prev)  # its KV writes end before a load lands in a freed block
            self.connector.start_load_kv(meta)
        handle = StepHandle(plan)
        self._plan(so, plan, handle, prev)
        handle.future = self.stream.submit(self._run_step, plan, prev)
        return handle

    def finish(self, handle: StepHandle) -> ModelRunnerOutput:
        """Wait for a launched step and build its output (loop thread)."""
        plan = handle.plan
        result: StepResult = handle.future.result()
        tokens = self.read_tokens(handle)
        out = ModelRunnerOutput()
        if plan.req_ids:
            slots = [-1] * len(plan.req_ids)
            for k, i in enumerate(plan.sample_segments):
                slots[i] = k
            out.req_ids = plan.req_ids
            out.sampled_token_ids = [[tokens[k]] if k >= 0 else [] for k in slots]
            if result.logprobs is not None:  # copied with the tokens: host memory now
                logprobs = result.logprobs.build(tokens)
                out.logprobs = [
                    [logprobs[k]] if k >= 0 and logprobs[k] is not None else [] for k in slots
                ]
            if plan.spec is not None:
                self._finish_spec(plan, result, out)
            for i in plan.sample_segments:
                prompt = plan.segments[i].prompt
                if prompt is not None:  # the prompt is done: its logprobs go out now
                    if out.prompt_logprobs is None:
                        out.prompt_logprobs = {}
                    out.prompt_logprobs[plan.req_ids[i]] = prompt[2]
        if self.connector is not None:
            sending, recving = self.connector.get_finished()
            invalid = self.connector.get_block_ids_with_load_errors()
            if sending or recving or invalid:
                out.kv_connector_output = KVConnectorOutput(
                    finished_sending=sorted(sending),
                    finished_recving=sorted(recving),
                    invalid_block_ids=sorted(invalid),
                )
        return out

    def _finish_spec(self, plan: StepPlan, result: StepResult, out: ModelRunnerOutput) -> None:
        """Speculative rows: their accepted tokens (and logprobs) into ``out``, and into
        the runner's copy of each request (``workers/runner/spec_step.py``)."""
        spec, verified = plan.spec, result.spec
        apply_result(spec, verified, self.block_size)
        if verified.logprobs is not None and out.logprobs is None:
            out.logprobs = [[] for _ in plan.req_ids]
        for k, i in enumerate(spec.segments):
            out.sampled_token_ids[i] = verified.token_ids[k]
            if verified.logprobs is not None:
                out.logprobs[i] = verified.logprobs[k]
