"""The sampler's CUDA-only choices, checked on CPU: the whole-row top-p sort CUDA takes (no
data-dependent fallback, so no device->host sync) cuts where the CPU's candidates-first
search cuts, for peaked rows (cut among the 256 candidates) and flat ones (cut beyond)."""

from __future__ import annotations

import torch

from tandem.wire.engine_protocol import SamplingParams
from tandem.workers.sampling import sampler


def test_top_p_whole_sort_cuts_like_the_candidates_search():
    g = torch.Generator().manual_seed(3)
    vocab = 5000
    peaked = torch.randn(4, vocab, generator=g) * 8.0
    flat = torch.randn(4, vocab, generator=g) * 0.05  # 256 tokens hold ~5% of the mass
    rows = torch.cat((peaked, flat))
    top_ps = [0.5, 0.9, 0.99, 0.3] * 2
    candidates = sampler._apply_top_p(rows, top_ps, full_sort=False)
    whole = sampler._apply_top_p(rows, top_ps, full_sort=True)
    kept = torch.isfinite(whole)
    assert torch.equal(kept, torch.isfinite(candidates))
    assert torch.equal(whole[kept], rows[kept])
    num_kept = kept.sum(dim=1)
    assert (num_kept[:4] < sampler._TOP_P_CANDIDATES).all()  # the cut among candidates
    assert (num_kept[4:] > sampler._TOP_P_CANDIDATES).all()  # the cut beyond them


def test_min_tokens_mask_with_index_tensors():
    logits = torch.zeros(3, 10)
    params = [SamplingParams(min_tokens=2, stop_token_ids=[4]), SamplingParams()]
    params.append(SamplingParams(min_tokens=1))
    masked = sampler._mask_min_tokens(logits, params, [0, 0, 1], [9, 9, 9])
    assert masked is not logits and torch.equal(logits, torch.zeros(3, 10))
    expected = torch.zeros(3, 10)
    expected[0, [4, 9]] = float("-inf")
    assert torch.equal(masked, expected)
