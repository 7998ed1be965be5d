"""Scheduler configuration, validated at construction.

``SchedulingConfig`` is the scheduling knobs a user sets (the engine's
``scheduler`` section, ``workers/config/``, extends it with the engine loop's
own knobs); ``SchedulerConfig`` is what one ``Scheduler`` runs with: those
knobs plus what the engine resolves at start-up (KV blocks, context length)
and the cache settings it shares with the KV cache.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from tandem.scheduler.block_hash import get_block_hasher
from tandem.scheduler.policies import POLICIES, check_fields
from tandem.scheduler.spec.config import SpeculativeConfig
from tandem.wire.config_fields import option


@dataclass
class SchedulingConfig:
    """How an engine's scheduler fills a step (scheduler/policies.py)."""

    max_num_seqs: int = option(128, per_pool=True, help="max running requests per engine")
    max_num_batched_tokens: int = option(2048, per_pool=True, help="token budget per step")
    enable_chunked_prefill: bool = option(
        True,
        per_pool=True,
        flag="--no-chunked-prefill",
        help="split long prompts over steps (--no-chunked-prefill: off)",
    )
    # A single prefill takes at most this many tokens per step (0 = no cap),
    # so one long prompt cannot starve the decodes batched with it.
    long_prefill_token_threshold: int = option(
        0,
        per_pool=True,
        help="prefill chunk cap; prompts with more tokens left are long (0 = none)",
    )
    policy: str = option(
        "fcfs", per_pool=True, flag="--scheduling-policy", help=" | ".join(POLICIES)
    )
    kv_admission_margin: float = option(
        0.0, per_pool=True, help="fraction of KV blocks kept free when admitting requests"
    )
    # Per step: requests in prefill (0 = no limit), of which long ones (more
    # than long_prefill_token_threshold tokens left; 0 = no limit).
    max_num_partial_prefills: int = option(
        0, per_pool=True, help="requests in prefill per step (0 = no limit)"
    )
    max_long_partial_prefills: int = option(
        0, per_pool=True, help="long prefills per step (0 = no limit); shorter prompts overtake"
    )

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(
                f"long_prefill_token_threshold must be >= 0, got {self.long_prefill_token_threshold}"
            )
        check_fields(self)  # policy, admission margin, partial prefill limits

    def scheduling_fields(self) -> dict[str, Any]:
        """The knobs of ``SchedulingConfig`` only, by name (a subclass's left out)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(SchedulingConfig)}


@dataclass
class SchedulerConfig(SchedulingConfig):
    """One scheduler's settings: the knobs above and the engine's resolved sizes."""

    num_kv_blocks: int = 1024
    block_size: int = 16
    max_model_len: int = 2048
    enable_prefix_caching: bool = True
    # Block hash of the prefix cache: sha256 | xxhash128 | builtin (block_hash.py).
    prefix_caching_hash_algo: str = "sha256"
    # What to do when a remote KV load fails: compute the KV locally, or
    # finish the request with FINISHED_ERROR.
    load_failure_policy: str = "recompute"
    # Speculative decoding (scheduler/spec/): None = off.
    speculative: SpeculativeConfig | None = None

    @classmethod
    def of(cls, scheduling: SchedulingConfig, **resolved: Any) -> SchedulerConfig:
        """The config of a scheduler running ``scheduling`` (an engine's section,
        taken whole) with the sizes and shared settings ``resolved`` names."""
        return cls(**scheduling.scheduling_fields(), **resolved)

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("num_kv_blocks", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        get_block_hasher(self.prefix_caching_hash_algo)  # ValueError naming the field
        if self.load_failure_policy not in ("recompute", "fail"):
            raise ValueError(
                f"load_failure_policy must be 'recompute' or 'fail', got {self.load_failure_policy!r}"
            )
        if self.num_kv_blocks * self.block_size < self.max_model_len:
            raise ValueError(
                f"num_kv_blocks ({self.num_kv_blocks}) x block_size ({self.block_size}) must hold "
                f"max_model_len ({self.max_model_len}) tokens, or a lone request could never finish"
            )
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                "max_num_batched_tokens must be >= max_model_len when chunked prefill is off "
                f"({self.max_num_batched_tokens} < {self.max_model_len})"
            )
