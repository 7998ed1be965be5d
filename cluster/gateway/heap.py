"""The gateway's startup heap, frozen out of the cyclic garbage collector's way.

By the time it serves, the gateway process holds a hundred thousand or more long-lived
objects: the modules it imported (tokenizers, ``transformers``' tokenizer side, FastAPI,
pydantic, the Ray driver), the tokenizer and the app. CPython's collector walks all of
them on every full (generation 2) collection, and serving triggers those regularly: the
objects of the requests in flight survive the young collections and count towards the
next full one. On the 2-core box one full collection over that heap took 0.1-0.2 s of CPU,
one per few tens of thousands of streamed tokens: 2-4 us of the gateway's CPU per token
(``benchmarks/serve_gateway.py``, issue #29).

``freeze_startup_heap`` collects once (startup garbage is not kept) and moves every
object alive into the collector's permanent generation (``gc.freeze``): reference
counting still frees them, the collector just no longer walks them, so a full collection
only looks at what serving allocated. ``tandem serve`` calls it once the app is built,
right before the server starts accepting connections.
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> int:
    """Collect, then freeze every object alive now; returns how many are frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
