"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds, logprobs.

Every random choice is a Gumbel-max draw ("exponential race"): with
``q_i ~ Exp(1)`` independent per vocabulary entry,
``argmax_i(logit_i / T - log q_i)`` is distributed as ``softmax(logit / T)``.
Filtering (top-k, top-p, min_tokens) sets logits to ``-inf`` first, so a
masked token can never win. The draw is a pure function of the filtered
logits and the noise vector, which makes seeded sampling reproducible:

    seeded row:   noise = Exp(1)^V from a generator seeded by mix64(seed, position)
    unseeded row: noise from one shared generator (one call for all such rows)

``position`` is the absolute index of the token being sampled (the number of
tokens before it), so a request split across a prefill engine and a decode
engine draws exactly the tokens it would draw on one engine, whatever its
batch mates. The stream depends on the device type (CPU and CUDA generators
differ) and on the vocabulary size, both fixed for one model deployment.
"""

from __future__ import annotations

import torch

from scheduler.messages import Logprobs, SamplingParams

# Below this temperature a row is sampled greedily: dividing by a tiny
# temperature overflows float32 and argmax is the limit anyway.
_MIN_TEMPERATURE = 1e-5
# Smallest exponential noise value: keeps -log(q) finite so that
# -inf (masked) + noise stays -inf instead of becoming NaN.
_MIN_NOISE = 1e-30
_MASK64 = (1 << 64) - 1


def mix_seed(seed: int, position: int) -> int:
    """64-bit seed for (request seed, token position): splitmix64 of both.

    Pure arithmetic on Python ints, identical in every process.
    """
    x = (seed & _MASK64) ^ ((position * 0x9E3779B97F4A7C15) & _MASK64)
    for _ in range(2):  # two splitmix64 rounds so nearby (seed, position) pairs decorrelate
        x = (x + 0x9E3779B97F4A7C15) & _MASK64
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
        x ^= x >> 31
    return x


class Sampler:
    """Samples one token per row of a logits batch.

    ``seed`` fixes the shared generator used by unseeded rows (for
    reproducible tests); ``None`` seeds it nondeterministically.
    """

    def __init__(self, seed: int | None = None) -> None:
        self._shared_seed = seed
        self._shared_generators: dict[torch.device, torch.Generator] = {}
        self._seeded_generators: dict[torch.device, torch.Generator] = {}

    def sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        positions: list[int],
        output_counts: list[int],
        eos_token_ids: list[int | None],
    ) -> tuple[list[int], list[Logprobs | None] | None]:
        """Sample one token per row.

        Args:
            logits: ``[N, V]`` float32 raw model logits (not modified).
            params: sampling parameters per row.
            positions: absolute position of the token being sampled per row
                (number of tokens before it in the sequence); keys seeded noise.
            output_counts: output tokens the row's request already has; while
                below ``min_tokens``, EOS and ``stop_token_ids`` are masked.
            eos_token_ids: EOS id per row (``None``: no EOS).

        Returns:
            ``(token_ids, logprobs)``. ``logprobs`` is ``None`` when no row asked
            for them, else one entry per row (``None`` for rows that did not
            ask). Logprobs are the log-softmax of the raw logits (before
            temperature and any masking), as OpenAI and vLLM report them; top
            entries are sorted by logprob, ties by lower token id.
        """
        num_rows, vocab_size = logits.shape
        if not (len(params) == len(positions) == len(output_counts) == len(eos_token_ids)):
            raise ValueError("params, positions, output_counts, eos_token_ids must match rows")
        if len(params) != num_rows:
            raise ValueError(f"{len(params)} params for {num_rows} logits rows")
        raw_logits = logits.float()

        masked = _mask_min_tokens(raw_logits, params, output_counts, eos_token_ids)
        token_ids = masked.argmax(dim=-1)
        random_rows = [
            i for i, p in enumerate(params) if p.temperature >= _MIN_TEMPERATURE and p.top_k != 1
        ]
        if random_rows:
            sampled = self._sample_random(masked, random_rows, params, positions, vocab_size)
            rows = torch.tensor(random_rows, device=logits.device)
            token_ids.index_copy_(0, rows, sampled)

        token_list = token_ids.tolist()
        return token_list, _compute_logprobs(raw_logits, params, token_list)

    def _sample_random(
        self,
        logits: torch.Tensor,
        rows: list[int],
        params: list[SamplingParams],
        positions: list[int],
        vocab_size: int,
    ) -> torch.Tensor:
        device = logits.device
        rows_t = torch.tensor(rows, device=device)
        temps = torch.tensor([params[i].temperature for i in rows], device=device)
        scaled = logits.index_select(0, rows_t) / temps.unsqueeze(1)
        scaled = _apply_top_k_top_p(scaled, [params[i] for i in rows], vocab_size)

        noise = torch.empty_like(scaled)
        unseeded = [j for j, i in enumerate(rows) if params[i].seed is None]
        if unseeded:
            gen = self._shared_generator(device)
            draws = torch.empty(len(unseeded), vocab_size, device=device)
            draws.exponential_(generator=gen)
            noise[torch.tensor(unseeded, device=device)] = draws
        seeded_gen = None
        for j, i in enumerate(rows):
            seed = params[i].seed
            if seed is None:
                continue
            if seeded_gen is None:
                seeded_gen = self._seeded_generator(device)
            seeded_gen.manual_seed(mix_seed(seed, positions[i]))
            noise[j].exponential_(generator=seeded_gen)
        gumbel = noise.clamp_(min=_MIN_NOISE).log_().neg_()
        return (scaled + gumbel).argmax(dim=-1)

    def _shared_generator(self, device: torch.device) -> torch.Generator:
        gen = self._shared_generators.get(device)
        if gen is None:
            gen = torch.Generator(device=device)
            if self._shared_seed is None:
                gen.seed()
            else:
                gen.manual_seed(self._shared_seed & _MASK64)
            self._shared_generators[device] = gen
        return gen

    def _seeded_generator(self, device: torch.device) -> torch.Generator:
        gen = self._seeded_generators.get(device)
        if gen is None:
            gen = torch.Generator(device=device)
            self._seeded_generators[device] = gen
        return gen


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
    masked[mask_rows, mask_ids] = float("-inf")
    return masked


def _apply_top_k_top_p(
    scaled: torch.Tensor, params: list[SamplingParams], vocab_size: int
) -> torch.Tensor:
    """Temperature-scaled logits with tokens outside top-k / top-p at -inf.

    top-k keeps every token whose logit is >= the k-th largest (ties at the
    boundary all stay, so the kept set never depends on sort order). top-p
    then keeps the smallest prefix of the remaining tokens, by descending
    probability, whose mass reaches ``top_p``; the most likely token is
    always kept.
    """
    top_ks = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
    top_ps = [p.top_p for p in params]
    need_k = any(k < vocab_size for k in top_ks)
    need_p = any(p < 1.0 for p in top_ps)
    if not (need_k or need_p):
        return scaled
    device = scaled.device
    k_index = torch.tensor(top_ks, device=device).sub_(1).unsqueeze(1)
    if not need_p:
        max_k = max(top_ks)
        top_values = scaled.topk(max_k, dim=-1).values
        kth_value = top_values.gather(1, k_index)
        return scaled.masked_fill(scaled < kth_value, float("-inf"))

    sorted_logits, sorted_ids = scaled.sort(dim=-1, descending=True, stable=True)
    kth_value = sorted_logits.gather(1, k_index)
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth_value, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1).sub_(probs)
    # Rows without top-p get an infinite threshold: rounding in the cumulative
    # sum must not trim their tail just because a batch mate needed sorting.
    thresholds = [p if p < 1.0 else float("inf") for p in top_ps]
    top_p = torch.tensor(thresholds, device=device, dtype=probs.dtype).unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(mass_before >= top_p, float("-inf"))
    return torch.empty_like(scaled).scatter_(1, sorted_ids, sorted_logits)


def _compute_logprobs(
    raw_logits: torch.Tensor, params: list[SamplingParams], token_ids: list[int]
) -> list[Logprobs | None] | None:
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    if not rows:
        return None
    device = raw_logits.device
    rows_t = torch.tensor(rows, device=device)
    logprobs = torch.log_softmax(raw_logits.index_select(0, rows_t), dim=-1)
    sampled = torch.tensor([token_ids[i] for i in rows], device=device).unsqueeze(1)
    sampled_lp = logprobs.gather(1, sampled).squeeze(1).tolist()

    num_tops = [min(params[i].logprobs, logprobs.shape[1]) for i in rows]
    max_top = max(num_tops)
    kth_values = None
    if max_top > 0:
        top_values = logprobs.topk(max_top, dim=-1).values
        kth_index = torch.tensor([max(n - 1, 0) for n in num_tops], device=device).unsqueeze(1)
        kth_values = top_values.gather(1, kth_index).squeeze(1)

    result: list[Logprobs | None] = [None] * len(params)
    for j, i in enumerate(rows):
        n = num_tops[j]
        top_ids: list[int] = []
        top_lps: list[float] = []
        if n and kth_values is not None:
            # Every candidate with logprob >= the n-th value, then a stable sort:
            # ties keep ascending token id whatever topk's internal order was.
            candidates = (logprobs[j] >= kth_values[j]).nonzero().squeeze(1)
            values = logprobs[j].index_select(0, candidates)
            order = values.argsort(descending=True, stable=True)[:n]
            top_ids = candidates.index_select(0, order).tolist()
            top_lps = values.index_select(0, order).tolist()
        result[i] = Logprobs(
            token_id=token_ids[i],
            logprob=sampled_lp[j],
            top_token_ids=top_ids,
            top_logprobs=top_lps,
        )
    return result
