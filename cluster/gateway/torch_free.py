"""The gateway process never imports torch.

The gateway (``tandem serve``'s own process: HTTP, routing, detokenizing, the Ray driver) needs
tokenizers, not a tensor library; with torch loaded it held ~550 MiB idle instead of ~100.
Our own gateway modules import nothing from the engine stack, but ``transformers`` imports
torch whenever it is installed, and the tokenizer comes from ``transformers``. So the serve
command bars torch for its process before anything imports ``transformers``:
``sys.modules["torch"] = None`` makes ``import torch`` raise ``ImportError`` and makes
``importlib.util.find_spec("torch")`` answer None, which is how ``transformers`` decides
torch is absent and loads tokenizers only (its supported tokenizer-only mode).

What needs torch in that process runs elsewhere: engines are Ray actors (their own
processes), and building the ``tiny`` checkpoint or converting a GGUF file runs in a child
interpreter (``workers.checkpoints.model_dir.resolve_model_dir``). Anything else that reaches
for torch fails loudly with ``ImportError`` instead of silently growing the process.

Tests and in-process tools (``ServiceThread``, ``tandem generate``) run the gateway beside
engines in one process and do not call this.
"""

from __future__ import annotations

import logging
import os
import sys

logger = logging.getLogger(__name__)


def bar_torch() -> bool:
    """Bar ``import torch`` in this process. Returns False (and bars nothing) when torch is
    already imported: then it is too late, and the caller's process simply keeps it."""
    if sys.modules.get("torch") is not None:
        logger.warning("torch was imported before the gateway could bar it")
        return False
    sys.modules["torch"] = None  # type: ignore[assignment]
    # Import transformers now, without its one advisory line for a torch-less process
    # ("PyTorch was not found..."), and leave the variable as it was for child processes.
    key = "TRANSFORMERS_NO_ADVISORY_WARNINGS"
    saved = os.environ.get(key)
    os.environ[key] = "1"
    try:
        import transformers  # noqa: F401
    finally:
        if saved is None:
            del os.environ[key]
        else:
            os.environ[key] = saved
    return True
