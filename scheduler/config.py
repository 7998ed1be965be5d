"""Scheduler configuration: one typed place, validated at construction."""

from __future__ import annotations

from dataclasses import dataclass

from tandem.scheduler.block_hash import get_block_hasher
from tandem.scheduler.policies import check_fields
from tandem.scheduler.spec.config import SpeculativeConfig


@dataclass
class SchedulerConfig:
    num_kv_blocks: int = 1024
    block_size: int = 16
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    # A single prefill takes at most this many tokens per step (0 = no cap),
    # so one long prompt cannot starve the decodes batched with it.
    long_prefill_token_threshold: int = 0
    enable_prefix_caching: bool = True
    # Block hash of the prefix cache: sha256 | xxhash128 | builtin (block_hash.py).
    prefix_caching_hash_algo: str = "sha256"
    # fcfs | priority | prefill-first (scheduler/policies.py)
    policy: str = "fcfs"
    # Fraction of the KV blocks kept free when admitting a request (0 = none).
    kv_admission_margin: float = 0.0
    # Per step: requests in prefill (0 = no limit), of which long ones (more
    # than long_prefill_token_threshold tokens left; 0 = no limit).
    max_num_partial_prefills: int = 0
    max_long_partial_prefills: int = 0
    # What to do when a remote KV load fails: compute the KV locally, or
    # finish the request with FINISHED_ERROR.
    load_failure_policy: str = "recompute"
    # Speculative decoding (scheduler/spec/): None = off.
    speculative: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        for name in ("num_kv_blocks", "block_size", "max_num_batched_tokens", "max_num_seqs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(
                f"long_prefill_token_threshold must be >= 0, got {self.long_prefill_token_threshold}"
            )
        get_block_hasher(self.prefix_caching_hash_algo)  # ValueError naming the field
        check_fields(self)  # policy, admission margin, partial prefill limits
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
