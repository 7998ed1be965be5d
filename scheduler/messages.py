"""Wire messages between gateway, scheduler, model runner and engines.

All messages are ``msgspec.Struct`` with ``array_like=True, omit_defaults=True``
so they encode small and fast. After a request's first step, only what
changed travels to the model runner (``CachedRequestData``).

    gateway --EngineRequest--> EngineCore --SchedulerOutput--> ModelRunner
    gateway <--EngineOutputs-- EngineCore <--ModelRunnerOutput-- ModelRunner
"""

from __future__ import annotations

import enum
import math
from typing import Any

import msgspec

from scheduler.request_timings import RequestTimings


class _Wire(msgspec.Struct, array_like=True, omit_defaults=True):
    pass


class SamplingParams(_Wire):
    """Per-request sampling and stopping rules; validated by ``validate()``."""

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs to return per token
    # Penalties (vLLM's semantics, workers/sampling/penalties.py): presence and
    # frequency count output tokens, repetition prompt and output tokens.
    presence_penalty: float = 0.0  # [-2, 2]
    frequency_penalty: float = 0.0  # [-2, 2]
    repetition_penalty: float = 1.0  # > 0; 1 = off
    min_p: float = 0.0  # [0, 1]; 0 = off
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    bad_words_token_ids: list[list[int]] = []  # token sequences never completed
    # Leading prompt_token_ids that are the client's prompt; the rest are
    # earlier outputs moved into the prompt (P/D handoff, migration) and stay
    # output tokens for the penalties. -1: all of prompt_token_ids.
    num_penalty_prompt_tokens: int = -1
    # Logprobs of every prompt token after the first, with this many top
    # alternatives (vLLM extra). The prompt is then computed, not read from
    # the prefix cache.
    prompt_logprobs: int | None = None

    def validate(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens!r}")
        if self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})"
            )
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (disabled) or >= 1, got {self.top_k!r}")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be >= 0, got {self.logprobs!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value!r}")
        if not (self.repetition_penalty > 0 and math.isfinite(self.repetition_penalty)):
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        for token_id, bias in (self.logit_bias or {}).items():
            if token_id < 0 or not -100.0 <= bias <= 100.0:
                raise ValueError(
                    f"logit_bias needs token ids >= 0 and values in [-100, 100], "
                    f"got {token_id!r}: {bias!r}"
                )
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise ValueError(f"prompt_logprobs must be >= 0, got {self.prompt_logprobs!r}")
        if any(not word for word in self.bad_words_token_ids):
            raise ValueError("bad_words_token_ids must not contain an empty word")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


class FinishReason(enum.IntEnum):
    STOP = 0  # EOS or a stop token / stop string
    LENGTH = 1  # max_tokens or max_model_len
    ABORT = 2
    ERROR = 3

    def __str__(self) -> str:
        return ("stop", "length", "abort", "error")[self.value]


class EngineRequest(_Wire):
    """A request as the gateway sends it to one engine."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = 0.0
    priority: int = 0
    # Tenant key of the prefix cache: requests share cached blocks only when
    # their salts are equal (scheduler/block_hash.py). None = the shared pool.
    cache_salt: str | None = None
    # Disaggregation: {"do_remote_decode": True} to a prefill engine; the
    # prefill engine's returned params plus {"do_remote_prefill": True} to a
    # decode engine. Decoded by kvtransfer.KVTransferParams.
    kv_transfer_params: dict[str, Any] | None = None
    # Parallel sampling: n choices from one prefill (scheduler/fork.py).
    n: int = 1


class EngineAbort(_Wire):
    request_ids: list[str]


# ---- scheduler -> model runner -------------------------------------------------


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


class KVConnectorOutput(_Wire):
    finished_sending: list[str] = []
    finished_recving: list[str] = []
    invalid_block_ids: list[int] = []  # blocks whose remote load failed


class Logprobs(_Wire):
    """Logprobs of one sampled token: its own and the top-N alternatives."""

    token_id: int
    logprob: float
    top_token_ids: list[int] = []
    top_logprobs: list[float] = []
    rank: int = 0  # 1 + tokens with a higher logprob; 0: not computed


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


# ---- engine -> gateway ---------------------------------------------------------


class EngineOutput(_Wire):
    request_id: str
    new_token_ids: list[int] = []
    new_logprobs: list[Logprobs] | None = None
    # on the first output with tokens, if asked: prompt tokens 1..n-1
    prompt_logprobs: list[Logprobs] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | None = None  # the stop token id that ended the request
    error: str | None = None
    # Prompt tokens this engine took from its prefix cache (not computed, not
    # read from a peer); set on the request's first output with tokens and on
    # its final output.
    num_cached_tokens: int = 0
    kv_transfer_params: dict[str, Any] | None = None
    # which choice of an n > 1 request these tokens belong to
    index: int = 0
    # Where the request's time went on this engine; on its final output only.
    timings: RequestTimings | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class SchedulerStats(_Wire):
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    num_waiting_for_remote_kvs: int = 0
    kv_cache_usage: float = 0.0
    num_blocks_held_for_transfer: int = 0
    prefix_cache_queries: int = 0  # tokens queried, cumulative
    prefix_cache_hits: int = 0  # tokens hit, cumulative
    num_preemptions: int = 0  # cumulative
    num_prompt_tokens: int = 0  # cumulative, computed (not cached)
    num_generation_tokens: int = 0  # cumulative


class EngineOutputs(_Wire):
    engine_id: str = ""
    outputs: list[EngineOutput] = []
    timestamp: float = 0.0
    scheduler_stats: SchedulerStats | None = None


class EngineHeartbeat(_Wire):
    """Sent by an engine's loop thread about every ``HEARTBEAT_INTERVAL_S``
    (between steps, never from another thread), so its arrival proves the
    loop is alive; ``num_steps`` (cumulative) shows whether it progresses."""

    engine_id: str = ""
    epoch: int = 0
    num_steps: int = 0


HEARTBEAT_INTERVAL_S = 0.5
