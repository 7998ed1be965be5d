"""The HTTP front door: the OpenAI-compatible app and its routes (``app.py``),
per-request generation (``generation.py``: the ``Gateway``, detokenizing, stop
strings), the ASGI response that streams or returns it (``responses.py``), the
OpenAI wire format (``protocol.py``: requests, validation, errors;
``formatting.py``: response bodies, SSE chunks), the edge's per-request limits
(``edge/``) and the routes beside generation (``api/``), over one ``Backend``
(``backend.py``; ``null_backend.py`` for tests and benchmarks).

May import ``cluster.observability``, scheduler messages and the tokenizer side
of ``workers``; never ``cluster.disagg``, ``cluster.engines`` or
``cluster.routing``. Other packages import only ``backend.py`` from here (the
contract), and ``cli`` the app.
"""
