"""Where built and converted checkpoints live, without torch (the gateway imports this).

``$TANDEM_CACHE_DIR`` or ``~/.cache/tandem``: the ``tiny`` checkpoint in ``TINY_VERSION``
(``workers/checkpoints/tiny.py`` builds it), converted GGUF files under the converter's
version (``workers/checkpoints/gguf_convert.py``).
"""

from __future__ import annotations

import os

TINY_VERSION = "tiny-v1"  # bump whenever the tiny checkpoint's contents change


def default_cache_dir() -> str:
    """``$TANDEM_CACHE_DIR`` or ``~/.cache/tandem``."""
    return os.environ.get("TANDEM_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "tandem"
    )


def built_tiny_dir(cache_dir: str | None = None) -> str | None:
    """The tiny checkpoint's directory if it is built (its ``config.json`` is the last thing
    to appear: the directory is renamed into place whole), else None."""
    final = os.path.join(cache_dir or default_cache_dir(), TINY_VERSION)
    return final if os.path.isfile(os.path.join(final, "config.json")) else None
