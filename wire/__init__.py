"""The internal planes' ZMQ sockets: what the engine sockets carry
(``engine_protocol``), what every frame must look like (``frames``) and who
may connect (``auth``).

Sockets of the internal planes (names used as the ``socket`` metric label):

    engine_input      engine PULL (bound)   <- gateway PUSH      R/A/U frames
    gateway_output    gateway PULL (bound)  <- engine PUSH       O/U/H frames
    kv_side_channel   prefill ROUTER (bound) <- decode REQ/DEALER handshake, notify
    kv_handshake_reply decode REQ           <- prefill ROUTER    handshake reply

Depends on msgspec and pyzmq only, so ``kvtransfer``, ``workers`` and
``cluster`` can all use it. For the same reason it holds ``config_fields``
(standard library only): the field metadata every layer's config class
carries, from which ``tandem serve``'s flags, YAML keys and reference page
are generated.
"""
