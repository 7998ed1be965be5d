"""The ``tandem`` command (``main.py``: generate, serve, drain, stop-engines,
bench) and what only it runs: ``serve.py`` starts engines, backend and gateway
from the typed configuration ``config/`` resolves (defaults < YAML < flags)
and ``settings.py`` turns into pool specs; ``check_config.py``, ``drain.py``,
``bench.py``, ``trace_replay.py``.

The top of the import graph: it may import every ``cluster`` package, and no
``cluster`` module imports it (``__main__`` aside).
"""
