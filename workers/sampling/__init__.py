"""Sampling: ``Sampler`` (sampler.py) turns a batch of logits into tokens
(temperature, top-k, top-p, seeds, logprobs); the features beyond those
(penalties, logit bias, bad words, min-p) keep per-request state for the
model runner (state.py, penalties.py); logprobs of sampled and prompt tokens
(sample_logprobs.py, prompt_logprobs.py).

May import ``kernels`` and ``wire``; imports torch. This ``__init__``
imports nothing.
"""
