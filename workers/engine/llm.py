"""Offline, in-process generation: ``LLM(model="tiny").generate(...)``.

Runs one EngineCore loop in the calling thread until every request finished.
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.wire.engine_protocol import EngineRequest, SamplingParams
from tandem.workers.config import EngineConfig
from tandem.workers.engine.core import EngineCore
from tandem.workers.parallel.messages import WorkerFailed
from tandem.workers.text.detokenizer import IncrementalDetokenizer
from tandem.workers.text.tokenizer import encode_prompt, load_tokenizer


@dataclass
class GenerationResult:
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    error: str | None = None
    num_cached_tokens: int = 0  # prompt tokens taken from the prefix cache


class LLM:
    def __init__(self, config: EngineConfig | None = None, **overrides) -> None:
        config = (
            (config or EngineConfig.from_flat()).replace(**overrides)
            if overrides
            else (config or EngineConfig.from_flat())
        )
        self.engine = EngineCore(config)
        try:
            self.tokenizer = load_tokenizer(self.engine.model_path)
        except (OSError, ValueError):
            self.tokenizer = None  # a bare checkpoint: token ids in and out, no text
        self._next_id = 0

    def close(self) -> None:
        """Stop the engine (and its tensor-parallel workers); idempotent."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def generate(
        self,
        prompts: list[str] | None = None,
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        *,
        prompt_token_ids: list[list[int]] | None = None,
        cache_salt: str | None = None,
    ) -> list[GenerationResult]:
        """Run every prompt to completion. ``cache_salt``: the prefix-cache
        tenant of these requests (they share cached blocks only with requests
        of the same salt)."""
        token_lists = list(prompt_token_ids or [])
        if prompts and self.tokenizer is None:
            raise ValueError("this model has no tokenizer files: pass prompt_token_ids")
        token_lists += [encode_prompt(self.tokenizer, p) for p in prompts or []]
        if not isinstance(sampling_params, list):
            sampling_params = [sampling_params or SamplingParams()] * len(token_lists)
        if len(sampling_params) != len(token_lists):
            raise ValueError("sampling_params must be one per prompt")
        ids, detoks, tokens, finish, errors, cached = [], {}, {}, {}, {}, {}
        for toks, sp in zip(token_lists, sampling_params):
            rid = f"gen-{self._next_id}"
            self._next_id += 1
            ids.append(rid)
            detoks[rid] = self.tokenizer and IncrementalDetokenizer(self.tokenizer, toks)
            tokens[rid] = []
            err = self.engine.add_request(EngineRequest(rid, list(toks), sp, cache_salt=cache_salt))
            if err is not None:
                finish[rid], errors[rid] = "error", err.error
        while self.engine.has_work():
            try:
                step_outputs = self.engine.step().outputs
            except WorkerFailed as exc:  # a TP worker died: every open request ends in error
                self.engine.abort(list(self.engine.scheduler.requests))
                for rid in ids:
                    if rid not in finish:
                        finish[rid], errors[rid] = "error", str(exc)
                break
            for o in step_outputs:
                tokens[o.request_id].extend(o.new_token_ids)
                cached[o.request_id] = max(cached.get(o.request_id, 0), o.num_cached_tokens)
                if detoks[o.request_id]:
                    detoks[o.request_id].update(o.new_token_ids)
                if o.finish_reason is not None:
                    finish[o.request_id] = str(o.finish_reason)
                    errors[o.request_id] = o.error
        results = []
        for rid, toks in zip(ids, token_lists):
            d = detoks[rid]
            text = d.text + d.finish() if d else ""
            results.append(
                GenerationResult(
                    list(toks),
                    tokens[rid],
                    text,
                    finish[rid],
                    errors.get(rid),
                    cached.get(rid, 0),
                )
            )
        return results
