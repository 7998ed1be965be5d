"""Speculative decoding, scheduler side: the ``--speculative-config`` settings, the
proposers that draft tokens, and the bookkeeping of drafts as lookahead tokens
(``scheduler/spec/lookahead.py``). The verification forward and the acceptance rule are
the model runner's (``workers/runner/spec_step.py``, ``workers/sampling/spec_verify.py``).
"""
