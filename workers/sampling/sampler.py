"""Token sampling: greedy, temperature, min-p, top-k, top-p, per-request seeds, logprobs.

Penalties, logit bias and bad words come in as ``BatchExtras``
(``workers/sampling/``) and change the logits every row samples from,
greedy rows included; logprobs stay those of the raw logits.

A random row is sampled by inverse CDF with ONE uniform number per row:

    probs = softmax(filtered logits / T)       (masked tokens: exactly 0)
    cdf   = cumsum(probs)
    token = first i with cdf[i] > u * cdf[-1]

so a masked token (zero-width interval) can never be drawn, and the cost is
a few passes over the logits instead of one random number per vocabulary
entry (per-element RNG dominates on CPU; per-row generator reseeding costs
a kernel launch each on GPU).

Seeds: for a seeded row, ``u`` is a pure function of (seed, position),
computed with integer arithmetic in Python (``uniform_for``), where position
is the absolute index of the token being sampled (the number of tokens
before it). A request split across a prefill engine and a decode engine
therefore draws exactly the tokens it would draw on one engine, whatever its
batch mates, process or call count. An unseeded row of the engine draws the
same way with its request's stream key (``Sampler.stream_key``: a hash of the
engine seed and the request id) in place of the seed, so no row's draw depends
on which other rows share its batch: a row the overlapped loop computes and
then drops (``scheduler/async_scheduler.py``) shifts nobody's stream. Callers
that pass no keys draw unseeded rows from one shared ``random.Random``.

Filtering keeps tokens by value, never by sort position: top-k keeps every
token >= the k-th largest logit, top-p every token >= the logit at which the
descending cumulative probability first reaches ``top_p`` (the most likely
token is always kept). Ties at a boundary all stay, so the kept set does not
depend on sort order or batch composition.
"""

from __future__ import annotations

import hashlib
import random

import torch

from tandem.kernels.metadata import list_to_device
from tandem.wire.engine_protocol import Logprobs, SamplingParams
from tandem.workers.sampling.grammar_mask import GrammarRows, apply_grammar_mask
from tandem.workers.sampling.penalties import apply_min_p
from tandem.workers.sampling.sample_logprobs import DeviceLogprobs, finish_top, top_on_device
from tandem.workers.sampling.state import BatchExtras

# Below this temperature a row is sampled greedily: dividing by a tiny
# temperature overflows float32 and argmax is the limit anyway.
_MIN_TEMPERATURE = 1e-5
# top-p looks for its cut among this many most likely tokens first; rows
# whose cut lies beyond fall back to a full sort. CPU only: on CUDA, finding
# those rows is a device->host sync, so every row gets the full sort there.
_TOP_P_CANDIDATES = 256
# argmax_rows: ids per chunk (a multiple of the SIMD width).
_ARGMAX_CHUNK = 128
_MASK64 = (1 << 64) - 1
_GOLDEN64 = 0x9E3779B97F4A7C15


def mix_seed(seed: int, position: int) -> int:
    """64-bit hash of (request seed, token position): two splitmix64 rounds."""
    x = (seed & _MASK64) ^ ((position * _GOLDEN64) & _MASK64)
    for _ in range(2):
        x = (x + _GOLDEN64) & _MASK64
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
        x ^= x >> 31
    return x


def uniform_for(seed: int, position: int) -> float:
    """The uniform number in [0, 1) a seeded request uses at ``position``."""
    return (mix_seed(seed, position) >> 11) * 2.0**-53


class Sampler:
    """Samples one token per row of a logits batch.

    ``seed`` fixes the stream of unseeded rows (reproducible tests);
    ``None`` seeds it from the OS.
    """

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)
        self._engine_key = random.Random(seed).getrandbits(64)

    def stream_key(self, request_id: str) -> int:
        """The key of an unseeded request's draws: a pure function of the engine seed
        and the request id (the OS picks the engine's part when ``seed`` is None)."""
        digest = hashlib.blake2b(request_id.encode(), digest_size=8).digest()
        return mix_seed(self._engine_key, int.from_bytes(digest, "little"))

    def sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        positions: list[int],
        output_counts: list[int],
        eos_token_ids: list[int | None],
        extras: BatchExtras | None = None,
        stream_keys: list[int] | None = None,
        grammar: GrammarRows | None = None,
    ) -> tuple[list[int], list[Logprobs | None] | None]:
        """Sample one token per row.

        Args:
            logits: ``[N, V]`` float32 raw model logits (not modified).
            params: sampling parameters per row.
            positions: absolute position of the token being sampled per row
                (number of tokens before it in the sequence); keys seeded rows.
            output_counts: output tokens the row's request already has; while
                below ``min_tokens``, EOS and ``stop_token_ids`` are masked.
            eos_token_ids: EOS id per row (``None``: no EOS).
            extras: logit bias, bad words and penalties of the rows that use
                them (``workers.sampling.state``), applied after the
                min_tokens mask and before temperature; min-p applies after
                temperature, before top-k/top-p.
            stream_keys: per row, the key unseeded rows draw with
                (``stream_key``); None: the shared stream.
            grammar: the structured-output bitmask of the constrained rows
                (``workers/sampling/grammar_mask.py``), applied before anything else.

        Returns:
            ``(token_ids, logprobs)``. Greedy rows (temperature 0 or top_k 1)
            get exactly the argmax, lowest id on ties. ``logprobs`` is
            ``None`` when no row asked for them, else one entry per row
            (``None`` for rows that did not ask): the log-softmax of the RAW
            logits (before temperature and masking), as OpenAI and vLLM
            report them; top entries sorted by logprob, ties by lower id.
        """
        token_ids, raw_logits = self.sample_on_device(
            logits, params, positions, output_counts, eos_token_ids, extras, stream_keys, grammar
        )
        token_list = token_ids.tolist()
        return token_list, compute_logprobs(raw_logits, params, token_list)

    def sample_on_device(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        positions: list[int],
        output_counts: list[int],
        eos_token_ids: list[int | None],
        extras: BatchExtras | None = None,
        stream_keys: list[int] | None = None,
        grammar: GrammarRows | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``sample`` without reading anything back: ``(token ids [N] on the logits'
        device, the float raw logits for compute_logprobs)``."""
        num_rows = logits.shape[0]
        if not (len(params) == len(positions) == len(output_counts) == len(eos_token_ids)):
            raise ValueError("params, positions, output_counts, eos_token_ids must match rows")
        if len(params) != num_rows:
            raise ValueError(f"{len(params)} params for {num_rows} logits rows")
        raw_logits = logits.float()

        masked = raw_logits
        if grammar is not None:
            masked = apply_grammar_mask(raw_logits, grammar)
            # constrained rows: their bitmask already holds stop tokens back for min_tokens
            # (unless the grammar allows nothing else), so no second mask can empty a row
            output_counts = list(output_counts)
            for row in grammar.rows:
                output_counts[row] = max(output_counts[row], params[row].min_tokens)
        masked = _mask_min_tokens(masked, params, output_counts, eos_token_ids)
        if extras is not None:
            masked = extras.apply(masked)
        token_ids = argmax_rows(masked)
        random_rows = [
            i for i, p in enumerate(params) if p.temperature >= _MIN_TEMPERATURE and p.top_k != 1
        ]
        if random_rows:
            uniforms = []
            for i in random_rows:
                seed = params[i].seed
                if seed is None and stream_keys is not None:
                    seed = stream_keys[i]
                uniforms.append(
                    self._rng.random() if seed is None else uniform_for(seed, positions[i])
                )
            rows = list_to_device(random_rows, logits.device)
            sampled = _sample_rows(
                masked.index_select(0, rows), [params[i] for i in random_rows], uniforms
            )
            token_ids.index_copy_(0, rows, sampled)
        return token_ids, raw_logits


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` of a ``[N, V]`` tensor: lowest id on ties.

    CPU argmax is scalar code (about 6 ms for 64 x 32000); ``amax`` is vectorised. So for
    large vocabularies: the max of every chunk of ``_ARGMAX_CHUNK`` ids, the first chunk
    holding the row's max, then argmax inside that chunk only (ids below it are smaller).
    """
    num_rows, vocab_size = logits.shape
    chunk = _ARGMAX_CHUNK
    if logits.is_cuda or vocab_size < 32 * chunk or num_rows == 0:
        return logits.argmax(dim=-1)
    num_chunks = vocab_size // chunk
    chunk_max = logits[:, : num_chunks * chunk].unflatten(1, (num_chunks, chunk)).amax(dim=-1)
    if num_chunks * chunk < vocab_size:
        tail_max = logits[:, num_chunks * chunk :].amax(dim=-1, keepdim=True)
        chunk_max = torch.cat((chunk_max, tail_max), dim=1)
    start = chunk_max.argmax(dim=-1) * chunk
    # The tail chunk is shorter: its columns past the end repeat the last id, after it.
    cols = (start[:, None] + torch.arange(chunk, device=logits.device)).clamp_(max=vocab_size - 1)
    return start + logits.gather(1, cols).argmax(dim=-1)


def _mask_min_tokens(
    logits: torch.Tensor,
    params: list[SamplingParams],
    output_counts: list[int],
    eos_token_ids: list[int | None],
) -> torch.Tensor:
    """Logits with EOS and stop ids at -inf for rows still below min_tokens.

    Returns ``logits`` itself when no row needs masking (no copy).
    """
    vocab_size = logits.shape[1]
    mask_rows: list[int] = []
    mask_ids: list[int] = []
    for i, p in enumerate(params):
        if output_counts[i] >= p.min_tokens:
            continue
        ids = list(p.stop_token_ids)
        if eos_token_ids[i] is not None:
            ids.append(eos_token_ids[i])
        for token_id in ids:
            if 0 <= token_id < vocab_size:
                mask_rows.append(i)
                mask_ids.append(token_id)
    if not mask_rows:
        return logits
    masked = logits.clone()
    # index tensors staged through pinned memory: list indices would copy from pageable
    # memory, which on CUDA waits for the whole queue (a hidden device->host sync)
    index = (list_to_device(mask_rows, logits.device), list_to_device(mask_ids, logits.device))
    masked.index_put_(index, torch.full((), float("-inf"), device=logits.device))
    return masked


def sampling_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The distribution a row is drawn from, per row of ``logits`` (already
    min_tokens-masked): temperature, then min-p, top-k, top-p. Speculative decoding's
    rejection sampling (``spec_verify.py``) verifies drafts against the same."""
    device = logits.device
    vocab_size = logits.shape[1]
    temps = list_to_device([p.temperature for p in params], device).unsqueeze(1)
    scaled = logits / temps
    min_ps = [p.min_p for p in params]
    if any(min_ps):
        scaled = apply_min_p(scaled, list_to_device(min_ps, device))
    top_ks = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
    if any(k < vocab_size for k in top_ks):
        scaled = _apply_top_k(scaled, top_ks)
    p_rows = [j for j, p in enumerate(params) if p.top_p < 1.0]
    if p_rows:
        index = list_to_device(p_rows, device)
        kept = _apply_top_p(scaled.index_select(0, index), [params[j].top_p for j in p_rows])
        scaled = scaled.index_copy(0, index, kept)
    return scaled.softmax(dim=-1)


def _sample_rows(
    logits: torch.Tensor, params: list[SamplingParams], uniforms: list[float]
) -> torch.Tensor:
    """Inverse-CDF draw per row of ``logits`` (already min_tokens-masked)."""
    device = logits.device
    vocab_size = logits.shape[1]
    probs = sampling_probs(logits, params)
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:]
    u = list_to_device(uniforms, device, torch.float64).unsqueeze(1)
    # Strictly below the total, so the search always lands inside the vocabulary.
    target = torch.minimum(
        (u * total.double()).float(), torch.nextafter(total, torch.zeros_like(total))
    )
    chosen = torch.searchsorted(cdf, target, right=True).clamp_(max=vocab_size - 1)
    # A zero-probability pick needs a non-monotone cumsum (parallel scans can
    # round that way); never let it through.
    valid = probs.gather(1, chosen) > 0
    return torch.where(valid, chosen, probs.argmax(dim=-1, keepdim=True)).squeeze(1)


def _apply_top_k(scaled: torch.Tensor, top_ks: list[int]) -> torch.Tensor:
    """Tokens below each row's k-th largest value set to -inf (k = V: none)."""
    k_index = list_to_device(top_ks, scaled.device).sub_(1).unsqueeze(1)
    top_values = scaled.topk(max(top_ks), dim=-1).values
    kth_value = top_values.gather(1, k_index)
    return scaled.masked_fill(scaled < kth_value, float("-inf"))


def _apply_top_p(
    scaled: torch.Tensor, top_ps: list[float], full_sort: bool | None = None
) -> torch.Tensor:
    """Tokens outside each row's nucleus set to -inf. ``full_sort`` (default: on CUDA)
    sorts every row whole instead of trying the candidates first: the same cut, and no
    data-dependent fallback, so no device->host sync."""
    device = scaled.device
    vocab_size = scaled.shape[1]
    top_p = list_to_device(top_ps, device).unsqueeze(1)
    log_total = scaled.logsumexp(dim=-1, keepdim=True)
    if full_sort is None:
        full_sort = scaled.is_cuda
    num_candidates = vocab_size if full_sort else min(vocab_size, _TOP_P_CANDIDATES)
    values = scaled.topk(num_candidates, dim=-1).values
    num_keep = _num_in_nucleus(values, log_total, top_p)
    cutoff = values.gather(1, (num_keep - 1).unsqueeze(1))
    if num_candidates < vocab_size:
        # The cut lies beyond the candidates when all of them are kept.
        beyond = (num_keep == num_candidates).nonzero().squeeze(1)
        if beyond.numel():
            rows = scaled.index_select(0, beyond)
            full = rows.sort(dim=-1, descending=True).values
            keep = _num_in_nucleus(full, log_total[beyond], top_p[beyond])
            cutoff[beyond] = full.gather(1, (keep - 1).unsqueeze(1))
    return scaled.masked_fill(scaled < cutoff, float("-inf"))


def _num_in_nucleus(
    sorted_values: torch.Tensor, log_total: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Per row: how many leading tokens to keep, >= 1 (mass before them < top_p)."""
    probs = (sorted_values - log_total).exp()
    mass_before = probs.cumsum(dim=-1).sub_(probs)
    return (mass_before < top_p).sum(dim=-1).clamp_(min=1)


def compute_logprobs(
    raw_logits: torch.Tensor, params: list[SamplingParams], token_ids: list[int]
) -> list[Logprobs | None] | None:
    """Logprobs of ``token_ids`` (one per row) under ``raw_logits``; None when no row asks.
    The engine does the same in two halves (``workers/sampling/sample_logprobs.py``)."""
    if all(p.logprobs is None for p in params):
        return None
    sampled = list_to_device(token_ids, raw_logits.device, torch.long)
    return DeviceLogprobs(raw_logits, params, sampled).build(token_ids)


def _top_logprobs(
    logprobs: torch.Tensor, num_tops: list[int]
) -> tuple[list[list[int]], list[list[float]]]:
    """Top-n ids and values per row, by value descending then id ascending."""
    num_rows = logprobs.shape[0]
    if max(num_tops) == 0:
        return [[] for _ in range(num_rows)], [[] for _ in range(num_rows)]
    ids, values, num_at_least = top_on_device(logprobs, num_tops)
    return finish_top(logprobs, ids.tolist(), values.tolist(), num_at_least.tolist(), num_tops)
