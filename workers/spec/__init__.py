"""Model-based proposers of speculative decoding, on the runner's side.

    draft_model.py   DraftModel: a smaller model with its own KV cache over the
                     target's block ids; fills a step's MODEL_DRAFT slots before
                     the verification forward
    loading.py       loading the draft at engine start, the shared-vocabulary check

The scheduler's side (how many drafts, their KV slots, acceptance) is
``scheduler/spec/``; verification is ``workers/sampling/spec_verify.py``.
Imports torch; this ``__init__`` imports nothing.
"""
