"""Sampling features beyond temperature/top-k/top-p (penalties, logit bias,
bad words, min-p): per-request state kept by the model runner, applied to a
batch of logits by ``workers.sampler.Sampler``."""
