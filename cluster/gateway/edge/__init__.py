"""The HTTP edge's protections, beside the gateway's per-token path.

    limits.py          GatewayLimits (the flags), request body limit (413),
                       concurrent-request cap (503 + Retry-After)
    tokenizer_pool.py  prompt tokenization and chat templating off the event loop,
                       with a length pre-check before any tokenizer work

Nothing here is on the per-token path: each check runs once per request.
"""
