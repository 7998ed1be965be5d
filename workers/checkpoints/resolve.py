"""``python -m tandem.workers.checkpoints.resolve MODEL``: print ``{"path": DIR}`` (or ``{"error":
..., "type": ...}`` and exit 2) as one JSON line. ``model_dir.resolve_model_dir`` runs it for a
process that bars torch (the gateway)."""

from __future__ import annotations

import json
import sys


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(json.dumps({"error": "usage: python -m tandem.workers.checkpoints.resolve MODEL"}))
        return 2
    from tandem.workers.checkpoints.loader import resolve_model_path

    try:
        path = resolve_model_path(argv[0])
    except (ValueError, FileNotFoundError) as exc:
        print(json.dumps({"error": str(exc), "type": type(exc).__name__}))
        return 2
    print(json.dumps({"path": path}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
