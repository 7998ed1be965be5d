"""The gateway's heap and CPython's cyclic garbage collector.

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

It also raises the young generation's threshold (``YOUNG_THRESHOLD``). CPython starts a
young collection whenever tracked allocations outrun deallocations by 700 (its default).
Streaming, every stream holds a few tracked objects across each event-loop turn (its
task's handle, the output it waits on, the ASGI message being written), and the more
streams, the more often the count crosses 700: a young collection ran about every 290
tokens at 256 streams against every 560 at 64, and each one promoted the objects of the
requests in flight (their tasks, frames, h11 connections) towards the older
generations, whose collections then walked all of them again. Counted in the server
(``gc.callbacks``, thread CPU time), collections took 0.3-0.9 us per token at 64
streams and 1.3-2.1 us at 256: part of why the gateway's CPU per token grows with the
number of streams. At 50,000 a young collection comes once per tens of thousands of
tokens (what accumulates in between is mostly the few dozen objects of cyclic garbage
each connection leaves) and walks at most that many objects, tens of milliseconds of
CPU on the loaded 2-core box: 0-0.9 us per token at either count, the full
collections gone from such a run. The older generations keep their thresholds.
"""

from __future__ import annotations

import gc

YOUNG_THRESHOLD = 50_000  # net tracked allocations between young collections (CPython: 700)


def freeze_startup_heap() -> int:
    """Collect, freeze every object alive now and raise the young generation's
    threshold to ``YOUNG_THRESHOLD``; returns how many objects are frozen."""
    gc.collect()
    gc.freeze()
    young, older, oldest = gc.get_threshold()
    gc.set_threshold(max(YOUNG_THRESHOLD, young), older, oldest)
    return gc.get_freeze_count()
