"""Tool calling: the request's tools and tool_choice (``request.py``), the parsers that read
tool calls in the model's text (``parsers.py``, a registry picked by ``--tool-call-parser``),
and the response shape, streamed as argument deltas (``formatting.py``)."""
