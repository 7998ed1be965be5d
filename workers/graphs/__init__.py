"""Decode CUDA graphs: batch-size buckets (``sizes``), static input buffers
(``static_inputs``), capture and replay (``runner``).

CUDA only (``runner.build_decode_graphs`` returns None on CPU or with ``--enforce-eager``);
the CPU keeps its eager fast paths. ``sizes`` is pure Python (``EngineConfig`` validates the
flag with it without importing torch).
"""
