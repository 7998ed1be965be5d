"""KV-aware routing: the cluster prefix index fed by engines' KV events
(``scheduler/kv_events.py``), and the router policies that score engines
with it (``policy.py``). See docs/architecture.md, "KV-aware routing"."""
