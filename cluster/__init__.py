"""The serving cluster: an OpenAI-compatible gateway in front of Ray engine
pools, with prefill -> decode disaggregation between them.

    cli/            the ``tandem`` command; ``serve`` wires everything below together
    gateway/        the HTTP app, the OpenAI wire format, edge limits, the Backend interface
    disagg/         RayBackend: a request's path across engines (P -> D, migration, drain)
    engines/        the engine actor, pools, placement, attach, health
    routing/        which engine gets a request (load router, KV-aware policies)
    observability/  metrics, tracing, dashboard, logs

Imports point down: ``cli`` may import any of them, ``disagg`` imports
``engines``, ``routing`` and ``gateway.backend`` (the interface it
implements), and the gateway never imports ``disagg``, ``engines`` or
``routing`` (``tests/unit/test_import_layers.py``).
"""
