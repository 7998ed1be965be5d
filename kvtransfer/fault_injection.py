"""Test hook: make NIXL READs fail on purpose. Off in production.

    TANDEM_FAULT_KV_READ_FAIL_FILE=/path/to/switch

The variable is read once, when the connector starts (unset: the hook costs
nothing and can never fire). While it names a file that exists, every READ
that completes is reported as failed (``ERR``, exactly as NIXL reports a broken
transfer), so the decode engine's load-failure policy runs: ``recompute``
prefills the lost blocks locally, ``fail`` ends the request with an error.
The chaos suite (``tests/chaos/``) creates and removes the file to switch the
fault on and off while the engines run.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

ENV_READ_FAIL_FILE = "TANDEM_FAULT_KV_READ_FAIL_FILE"


class ReadFaults:
    def __init__(self, environ: Mapping[str, str] = os.environ) -> None:
        self.switch_path = environ.get(ENV_READ_FAIL_FILE) or None

    def fail_this_read(self) -> bool:
        """True when a completed READ must be reported as failed."""
        return self.switch_path is not None and os.path.exists(self.switch_path)
