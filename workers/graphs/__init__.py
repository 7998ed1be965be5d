"""CUDA graphs: the modes and sizes (``sizes``), full decode graphs (``static_inputs``,
``runner``), piecewise graphs around eager attention (``token_inputs``, ``piecewise``), the
engine's choice of them (``build``) and their memory, measured before the KV cache is sized
(``memory``).

CUDA only (``build.build_step_graphs`` returns no runner on CPU or with ``--enforce-eager``);
the CPU keeps its eager fast paths. ``sizes`` is pure Python (``EngineConfig`` validates the
flags with it without importing torch).
"""
