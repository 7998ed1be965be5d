"""One engine: ``EngineCore`` (core.py) steps the scheduler and the model
runner; ``EngineService`` (service.py) serves it over the ZMQ sockets of the
engine protocol (``wire/engine_protocol.py``); ``startup.py`` builds what it
steps with (model, KV cache, graphs, runner).

May import ``scheduler``, ``kvtransfer``, ``wire`` and the rest of
``workers``; imports torch, so the gateway never imports it. Kept empty:
import the modules.
"""
