"""One engine and its loop.

    core.py                EngineCore: add_request / abort / step / stats; no sockets
    service.py             EngineService: the engine served over ZMQ (wire/engine_protocol.py):
                           the loop, heartbeats, utility and control calls, gateway switch
    startup.py             start-up: model, compile, step-memory profile, KV cache, graphs, runner
    loop_wait.py           how long the loop waits on its input socket
    output_sender.py       the output socket's bounded send queue (backpressure)
    request_clock.py       per-request timings reported on the final output
    kv_events_publisher.py the KV events PUB socket
    llm.py                 LLM: offline, in-process generation on one EngineCore

May import ``scheduler``, ``kvtransfer``, ``wire``, ``kernels`` and the rest
of ``workers``. Its modules import torch, so the gateway imports none of
them; this ``__init__`` imports nothing.
"""
