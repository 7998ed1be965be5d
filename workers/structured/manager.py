"""The engine's side of structured outputs: the compile pool, the grammar cache and one
matcher per constrained request. The scheduler drives it (duck-typed, ``scheduler/``
imports no grammar code):

    add_request   -> submit(req)             compile off the step, on the pool's threads
    each schedule -> poll(req)               WAITING_FOR_FSM until the grammar is ready
                                             (ValueError: invalid, or past the deadline)
                  -> num_allowed_drafts(req, drafts)   speculative drafts its grammar takes
                  -> bitmask(reqs)           one int32 row per position that samples
    each output   -> accept(req, tokens)     advance its matcher (-> how many it took)
    finish        -> remove(req_id)

A request's matcher is built from its spec and replayed over the tokens it already has
after the client's prompt (``SamplingParams.num_penalty_prompt_tokens``: the token a
prefill engine sampled, or what a migrated stream already sent), so a decode engine or a
migration target continues exactly where the other engine stopped. Fork children
(``n > 1``) get their matchers the same way, from the cached grammar.

The cache is keyed by (tokenizer, kind, text) and bounded (least recently used out); a
compile in flight is shared by every request with the same spec.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from tandem.scheduler.engine_stats import Histogram, StructuredOutputStats
from tandem.scheduler.request import Request
from tandem.wire.config_fields import default_of
from tandem.wire.engine_protocol import StructuredOutputsParams
from tandem.workers.config.sections import EngineSchedulingConfig
from tandem.workers.structured.backend import GrammarBackend, Matcher, bitmask_width

# --structured-outputs-compile-timeout-s (the engine's scheduling section)
COMPILE_TIMEOUT_S: float = default_of(
    EngineSchedulingConfig, "structured_outputs_compile_timeout_s"
)

_COMPILE_BOUNDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_MASK_BOUNDS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05)


def _key(spec: StructuredOutputsParams) -> tuple[str, str]:
    return (spec.kind, spec.text)


class GrammarCache:
    """Compiled grammars of one backend (one tokenizer), least recently used out."""

    def __init__(self, backend: GrammarBackend, max_entries: int = 512) -> None:
        self.backend = backend
        self.max_entries = max_entries
        self._entries: collections.OrderedDict[tuple[str, str], Any] = collections.OrderedDict()
        self._lock = threading.Lock()

    def lookup(self, spec: StructuredOutputsParams) -> Any | None:
        with self._lock:
            compiled = self._entries.get(_key(spec))
            if compiled is not None:
                self._entries.move_to_end(_key(spec))
            return compiled

    def put(self, spec: StructuredOutputsParams, compiled: Any) -> None:
        with self._lock:
            self._entries[_key(spec)] = compiled
            self._entries.move_to_end(_key(spec))
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)

    def get_or_compile(self, spec: StructuredOutputsParams) -> Any:
        compiled = self.lookup(spec)
        if compiled is None:
            compiled = self.backend.compile(spec)
            self.put(spec, compiled)
        return compiled


class StructuredOutputManager:
    """Loop thread only, except the compile functions its pool runs. ``make_backend`` is
    called once, on a pool thread (loading the tokenizer's vocabulary takes a second)."""

    def __init__(
        self,
        make_backend: Callable[[], GrammarBackend],
        backend_name: str,
        vocab_size: int,
        *,
        num_workers: int = 1,
        compile_timeout_s: float = COMPILE_TIMEOUT_S,
        max_cache_entries: int = 512,
    ) -> None:
        self._make_backend = make_backend
        self._backend: GrammarBackend | None = None
        self._backend_lock = threading.Lock()
        self.backend_name = backend_name
        self.width = bitmask_width(vocab_size)
        self.compile_timeout_s = compile_timeout_s
        self.max_cache_entries = max_cache_entries
        self._cache: GrammarCache | None = None
        self._pool = ThreadPoolExecutor(num_workers, "tandem-grammar")
        self._in_flight: dict[tuple[str, str], Future] = {}
        self._submitted: dict[str, tuple[Future, float]] = {}  # req id -> (compile, deadline)
        self.matchers: dict[str, Matcher] = {}
        self.stats = StructuredOutputStats(backend=backend_name)
        self._compile_seconds = Histogram(_COMPILE_BOUNDS)
        self._mask_seconds = Histogram(_MASK_BOUNDS)
        self._done_times: list[float] = []  # compile durations from pool threads

    # ---- compile pool ----------------------------------------------------------------

    def _cache_now(self) -> GrammarCache:
        with self._backend_lock:
            if self._cache is None:
                self._backend = self._make_backend()
                self._cache = GrammarCache(self._backend, self.max_cache_entries)
            return self._cache

    def _compile(self, spec: StructuredOutputsParams) -> Any:
        cache = self._cache_now()
        start = time.perf_counter()
        compiled = cache.backend.compile(spec)
        cache.put(spec, compiled)
        self._done_times.append(time.perf_counter() - start)  # list.append: atomic
        return compiled

    def submit(self, req: Request) -> None:
        """Start compiling ``req``'s grammar unless it is cached or already compiling."""
        spec = req.sampling_params.structured_outputs
        assert spec is not None
        self.stats.constrained_requests_total += 1
        key = _key(spec)
        fut = self._in_flight.get(key)
        cached = self._cache.lookup(spec) if self._cache is not None else None
        if cached is not None or fut is not None:
            self.stats.cache_hits_total += 1
            if fut is None:
                fut = Future()
                fut.set_result(cached)
        else:
            self.stats.cache_misses_total += 1
            fut = self._pool.submit(self._compile, spec)
            self._in_flight[key] = fut
        self._submitted[req.request_id] = (fut, time.monotonic() + self.compile_timeout_s)

    def poll(self, req: Request) -> bool:
        """Is ``req``'s grammar ready (its matcher then exists)? ``ValueError`` when the
        grammar failed to compile or missed its deadline (the request ends in error)."""
        rid = req.request_id
        fut, deadline = self._submitted[rid]
        if not fut.done():
            if time.monotonic() < deadline:
                return False
            self._forget_submission(req)
            self.stats.compile_failures_total += 1
            raise ValueError(
                f"structured_outputs: the grammar did not compile within "
                f"{self.compile_timeout_s:g} s"
            )
        self._forget_submission(req)
        try:
            compiled = fut.result()
        except Exception as exc:  # noqa: BLE001 - a grammar the backend refused
            self.stats.compile_failures_total += 1
            raise ValueError(f"structured_outputs: {exc}") from None
        self._start_matcher(req, compiled)
        return True

    def _forget_submission(self, req: Request) -> None:
        fut, _ = self._submitted.pop(req.request_id)
        key = _key(req.sampling_params.structured_outputs)
        if fut.done() and self._in_flight.get(key) is fut:
            del self._in_flight[key]

    def _start_matcher(self, req: Request, compiled: Any) -> None:
        assert self._backend is not None
        matcher = self._backend.matcher(compiled)
        sp = req.sampling_params
        start = sp.num_penalty_prompt_tokens
        if start < 0:
            start = req.num_prompt_tokens
        earlier = req.all_token_ids[start:]  # sampled by another engine, or before
        if earlier and matcher.advance(earlier) != len(earlier):
            raise ValueError("structured_outputs: the request's earlier output breaks its grammar")
        self.matchers[req.request_id] = matcher

    def matcher_for(self, req: Request) -> Matcher:
        """The request's matcher; a fork child's is built from the cached grammar (the
        scheduler asks when it creates the children)."""
        matcher = self.matchers.get(req.request_id)
        if matcher is None:
            cache = self._cache_now()
            spec = req.sampling_params.structured_outputs
            hit = cache.lookup(spec) is not None
            self.stats.cache_hits_total += hit
            self.stats.cache_misses_total += not hit
            self._start_matcher(req, cache.get_or_compile(spec))
            matcher = self.matchers[req.request_id]
        return matcher

    # ---- per step ------------------------------------------------------------------

    def num_allowed_drafts(self, req: Request, drafts: list[int]) -> int:
        """How many of ``drafts`` (after the request's tokens) its grammar accepts: a
        tentative walk, rolled back, so the matcher ends where it started."""
        matcher = self.matcher_for(req)
        num = matcher.advance(drafts)
        matcher.rollback(num)
        return num

    def bitmask(self, reqs: list[Request]) -> bytes:
        """Rows (int32, bit set = token allowed), row-major bytes: one per request, or
        ``1 + k`` for a request with ``k`` drafts (``req.spec_token_ids``, all accepted by
        its grammar: ``num_allowed_drafts``). Row ``j`` allows what may follow the
        request's tokens and drafts ``d1 .. dj``; the matcher walks through the drafts to
        fill them and rolls back, so only the tokens verification keeps advance it
        (``accept``)."""
        start = time.perf_counter()
        bitmask = np.zeros((sum(1 + len(r.spec_token_ids) for r in reqs), self.width), np.int32)
        row = 0
        for req in reqs:
            matcher = self.matcher_for(req)
            drafts = req.spec_token_ids
            sp = req.sampling_params
            stops = [req.eos_token_id, *sp.stop_token_ids]
            for j in range(len(drafts) + 1):
                if j and matcher.advance(drafts[j - 1 : j]) != 1:
                    raise AssertionError(f"{req.request_id}: a draft its grammar refuses")
                matcher.fill_bitmask(bitmask, row)
                if req.num_output_tokens + j < sp.min_tokens:  # drafts before row j: outputs
                    _hold_back_stops(bitmask[row], stops)
                row += 1
            if drafts:
                matcher.rollback(len(drafts))
        self._mask_seconds.observe(time.perf_counter() - start)
        return bitmask.tobytes()

    def accept(self, req: Request, tokens: list[int]) -> int:
        """Advance the request's matcher by its new tokens; how many it accepted."""
        return self.matchers[req.request_id].advance(tokens)

    def is_terminated(self, req: Request) -> bool:
        matcher = self.matchers.get(req.request_id)
        return matcher is not None and matcher.is_terminated()

    def remove(self, req: Request) -> None:
        self.matchers.pop(req.request_id, None)
        if req.request_id in self._submitted:
            self._forget_submission(req)

    # ---- state ----------------------------------------------------------------------

    def make_stats(self) -> StructuredOutputStats:
        while self._done_times:
            self._compile_seconds.observe(self._done_times.pop())
        self.stats.compile_seconds = self._compile_seconds.snapshot()
        self.stats.mask_seconds = self._mask_seconds.snapshot()
        return self.stats

    def check_integrity(self, request_ids: set[str]) -> None:
        stray = (set(self.matchers) | set(self._submitted)) - request_ids
        assert not stray, f"grammar state of unknown requests: {sorted(stray)}"

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _hold_back_stops(row: np.ndarray, stop_ids: list[int | None]) -> None:
    """``min_tokens`` for a constrained row: clear its stop tokens' bits unless nothing else
    is allowed (a grammar that has ended still ends; the sampler does not mask stop tokens of
    constrained rows, ``workers/sampling/sampler.py``)."""
    saved = row.copy()
    words = row.view(np.uint32)
    for token in stop_ids:
        if token is not None and 0 <= token < 32 * len(words):
            words[token // 32] &= np.uint32(~(1 << (token % 32)) & 0xFFFFFFFF)
    if not row.any():
        row[:] = saved


def structured_manager(
    model_path: str,
    vocab_size: int,
    eos_token_ids: list[int | None],
    backend: str = "llguidance",
    compile_timeout_s: float = COMPILE_TIMEOUT_S,
) -> StructuredOutputManager:
    """The engine's manager; the tokenizer is loaded on the first compile (pool thread)."""
    eos = [t for t in eos_token_ids if t is not None]

    def make() -> GrammarBackend:
        from tandem.workers.structured.backend import make_backend
        from tandem.workers.text.tokenizer import load_tokenizer

        return make_backend(backend, load_tokenizer(model_path), vocab_size, eos)

    return StructuredOutputManager(make, backend, vocab_size, compile_timeout_s=compile_timeout_s)
