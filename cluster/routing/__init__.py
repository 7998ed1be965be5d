"""Which engine gets a request: the load counters (``router.py``), the cluster
prefix index fed by engines' KV events (``index.py``, ``subscriber.py``; from
``scheduler/kv_events.py``) and the policies that score engines with it
(``policy.py``, composed by ``cluster_routing.py``). See docs/architecture.md,
"KV-aware routing".

May import scheduler, wire and ``cluster.gateway.backend`` (the metric types
``metrics.py`` renders); nothing else of ``cluster``.
"""
