"""One engine: its loop and process (``engine/``), the model runner (``runner/``), models and
checkpoints (``models/``, ``checkpoints/``), sampling (``sampling/``), CUDA graphs and
torch.compile (``graphs/``, ``compile/``), tensor parallelism (``parallel/``), the tokenizer
and detokenizer the gateway uses (``text/``, torch-free) and ``config/`` (``EngineConfig``, a
tree of sections, torch-free).

May import ``kernels``, ``kvtransfer``, ``scheduler`` and ``wire``; never ``cluster``. Importing
this package imports nothing (sub-packages are imported by name).
"""
