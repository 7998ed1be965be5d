"""The engine protocol: every message between the gateway and its engines,
and the two sockets' frame specs. Depends on msgspec only (and
``wire.frames``): the gateway imports it without importing torch, and so
does anything else that talks to an engine.

    engine_input    gateway PUSH --[b"R", EngineRequest | b"A", EngineAbort
                                    | b"U", UtilityCall]--> engine PULL
    gateway_output  engine PUSH  --[b"O", EngineOutputs | b"U", UtilityResult
                                    | b"H", EngineHeartbeat]--> gateway PULL

All messages are ``msgspec.Struct`` with ``array_like=True, omit_defaults=True``
(``UtilityCall`` without ``omit_defaults``) so they encode small and fast: a
field's position is its identity on the wire, so new fields go last, with a
default (``tests/wire/test_engine_protocol.py`` pins the bytes).

``RequestTimings`` is what an engine reports about where one request's time
went, on the request's final output. Every time is seconds on the engine's
own monotonic clock, counted from when the engine received the request
(``Request.arrival_mono``): no wall clock is compared across processes. The gateway places the engine's timeline in its
own by anchoring ``finished_s`` at the moment the output arrived
(``cluster/observability/tracing/record.py``).

    receipt --queue--> scheduled --compute--> first token --decode--> finished
    D only:  receipt --> kv_load_start --(READ)--> kv_load_end --> first token

A time that did not happen is ``-1.0`` (``NOT_REACHED``).
"""

from __future__ import annotations

import enum
import math
from typing import Annotated, Any

import msgspec

from tandem.wire.frames import FrameSpec, MiB


class _Wire(msgspec.Struct, array_like=True, omit_defaults=True):
    pass


# ---- gateway -> engine ---------------------------------------------------------


# What a constrained request's output must match (``StructuredOutputsParams.kind``):
# a JSON schema, any JSON object, a regular expression, one of a JSON list of strings,
# or a grammar (Lark, or GBNF/EBNF as llama.cpp writes it).
STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")


class StructuredOutputsParams(_Wire):
    """A request's output constraint as it travels: plain text, never a compiled object,
    so any engine (prefill, decode, a migration's target) builds its own matcher from it
    (``workers/structured/``). ``text``: the JSON schema's JSON, the regex, the JSON list
    of choices, the grammar text; empty for ``json_object``."""

    kind: str
    text: str = ""

    def validate(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise ValueError(
                f"structured_outputs.kind must be one of {', '.join(STRUCTURED_KINDS)}, "
                f"got {self.kind!r}"
            )
        if self.kind != "json_object" and not self.text:
            raise ValueError(f"structured_outputs.text must not be empty for {self.kind!r}")


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
    # The output must match this (workers/structured/); None: unconstrained.
    structured_outputs: StructuredOutputsParams | None = None

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
        if self.structured_outputs is not None:
            self.structured_outputs.validate()

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
    # The return address: the session of the gateway whose output socket gets
    # this request's outputs (workers/engine/gateway_outputs.py). 0 = the
    # engine's default gateway (a single-gateway caller).
    gateway: int = 0


class EngineAbort(_Wire):
    request_ids: list[str]


class UtilityCall(msgspec.Struct, array_like=True):
    """Call ``method`` (one of the engine's utilities) with ``args`` on the
    engine's loop thread; answered by a ``UtilityResult`` of the same ``call_id``."""

    call_id: int
    method: str
    args: list[Any] = []


# ---- engine -> gateway ---------------------------------------------------------


class UtilityResult(msgspec.Struct, array_like=True, omit_defaults=True):
    call_id: int
    result: Any = None
    error: str | None = None


NOT_REACHED = -1.0

_Seconds = Annotated[float, msgspec.Meta(ge=NOT_REACHED)]
_Count = Annotated[int, msgspec.Meta(ge=0)]


class RequestTimings(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True):
    """Sent once per request and engine, on the engine's final output for it
    (P's only output under P/D). Validated by msgspec on the gateway's socket
    (``wire/frames.py``): a negative duration or count makes the frame
    malformed."""

    engine_id: str
    epoch: int
    role: str  # "prefill" | "decode" | "colocated"
    finished_s: _Seconds  # receipt -> this final output
    scheduled_s: _Seconds = NOT_REACHED  # receipt -> first scheduled to compute
    first_token_s: _Seconds = NOT_REACHED  # receipt -> first token sampled here
    kv_load_start_s: _Seconds = NOT_REACHED  # receipt -> blocks allocated for a remote READ
    kv_load_end_s: _Seconds = NOT_REACHED  # receipt -> the READ landed (or failed)
    num_kv_blocks: _Count = 0  # blocks read from the prefill engine
    num_kv_bytes: _Count = 0
    num_kv_descriptors: _Count = 0  # NIXL descriptors of the READ
    num_preemptions: _Count = 0

    @property
    def queue_s(self) -> float:
        """Receipt to the first compute or the start of the KV load."""
        starts = [t for t in (self.scheduled_s, self.kv_load_start_s) if t >= 0]
        return min(starts) if starts else NOT_REACHED

    @property
    def kv_load_s(self) -> float:
        if self.kv_load_start_s < 0 or self.kv_load_end_s < 0:
            return NOT_REACHED
        return self.kv_load_end_s - self.kv_load_start_s


class Logprobs(_Wire):
    """Logprobs of one sampled token: its own and the top-N alternatives."""

    token_id: int
    logprob: float
    top_token_ids: list[int] = []
    top_logprobs: list[float] = []
    rank: int = 0  # 1 + tokens with a higher logprob; 0: not computed


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
    # speculative decoding (scheduler/spec/), cumulative: requests' steps with drafts,
    # drafts, accepted drafts, and accepted drafts by position in the draft (0 = first)
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = []


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


# ---- the sockets (``wire.frames``) --------------------------------------------

# What an engine's input socket accepts. 64 MiB holds a prompt of millions of
# token ids; the socket cuts a sender at 4x that.
ENGINE_INPUT = FrameSpec(
    "engine_input",
    {b"R": EngineRequest, b"A": EngineAbort, b"U": UtilityCall},
    max_frame_bytes=64 * MiB,
)

# What the gateway's output socket accepts: a batch of outputs, a utility
# reply (engines answer ZMQ utility calls there; the gateway makes none), or
# a heartbeat.
GATEWAY_OUTPUT = FrameSpec(
    "gateway_output",
    {b"O": EngineOutputs, b"U": UtilityResult, b"H": EngineHeartbeat},
    max_frame_bytes=64 * MiB,
)
