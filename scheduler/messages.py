"""Messages between the scheduler and the model runner, inside one engine
(and to its tensor-parallel workers). What crosses to the gateway is in
``wire/engine_protocol.py``.

After a request's first step, only what changed travels to the model runner
(``CachedRequestData``):

    gateway --EngineRequest--> EngineCore --SchedulerOutput--> ModelRunner
    gateway <--EngineOutputs-- EngineCore <--ModelRunnerOutput-- ModelRunner
"""

from __future__ import annotations

from typing import Any

import msgspec

from tandem.wire.engine_protocol import Logprobs, SamplingParams


class _Wire(msgspec.Struct, array_like=True, omit_defaults=True):
    pass


class NewRequestData(_Wire):
    """First time the runner sees a request (or a preempted one resuming).

    ``all_token_ids`` holds prompt + any output tokens so far; the runner
    computes from ``num_computed_tokens`` on.
    """

    req_id: str
    all_token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int


class CachedRequestData(_Wire):
    """Diffs for requests the runner already holds. Parallel lists."""

    req_ids: list[str] = []
    new_block_ids: list[list[int]] = []  # blocks appended since last step
    num_computed_tokens: list[int] = []
    # Tokens the runner did not sample itself (none today; kept for the seam
    # of speculative decoding / migration).
    new_token_ids: list[list[int]] = []


class GrammarBitmask(_Wire):
    """Token masks of a step's constrained requests that sample
    (``scheduler/structured_grammar.py``): ``bitmask`` is int32 rows, row-major, one per
    id of ``req_ids``, ``ceil(vocab / 32)`` words each; bit ``t % 32`` of word ``t // 32``
    set = token ``t`` allowed."""

    req_ids: list[str]
    bitmask: bytes


class SchedulerOutput(_Wire):
    scheduled_new_reqs: list[NewRequestData] = []
    scheduled_cached_reqs: CachedRequestData = msgspec.field(default_factory=CachedRequestData)
    num_scheduled_tokens: dict[str, int] = {}
    total_num_scheduled_tokens: int = 0
    # Requests the runner must forget (finished, aborted or preempted).
    finished_req_ids: list[str] = []
    preempted_req_ids: list[str] = []
    kv_connector_metadata: Any = None
    # (src, dst) KV blocks to copy before this step's forward pass (a fork's
    # partial last block, scheduler/fork.py)
    copy_block_ids: list[tuple[int, int]] = []
    # None when no request that samples this step is constrained (the common case)
    grammar_bitmask: GrammarBitmask | None = None
    # req id -> drafts scheduled after its last token (speculative decoding,
    # scheduler/spec/): the step computes them and samples each of their positions
    scheduled_spec_decode_tokens: dict[str, list[int]] = {}
    # req id -> positions of a draft model's KV recomputed this step before the request's
    # last token (scheduler/drafting.py): for a request with drafts, the first draft
    # forward's catch-up; for one without, positions draft_computed .. + n (counted in
    # total_num_scheduled_tokens)
    draft_catch_up: dict[str, int] = {}


class KVConnectorOutput(_Wire):
    finished_sending: list[str] = []
    finished_recving: list[str] = []
    invalid_block_ids: list[int] = []  # blocks whose remote load failed


class ModelRunnerOutput(_Wire):
    """Per scheduled request: tokens sampled this step (empty while a
    chunked prefill is still partial)."""

    req_ids: list[str] = []
    sampled_token_ids: list[list[int]] = []
    logprobs: list[list[Logprobs]] | None = None
    # req id -> logprobs of prompt tokens 1..n-1, with the step that samples
    # the request's first token
    prompt_logprobs: dict[str, list[Logprobs]] | None = None
    kv_connector_output: KVConnectorOutput | None = None
