"""What the gateway process costs before any request: import seconds, RSS, and whether torch
is loaded (issue #24: the gateway must not import torch).

    .venv/bin/python benchmarks/gateway_footprint.py                 # this checkout, 5 runs
    .venv/bin/python benchmarks/gateway_footprint.py --root DIR      # another checkout

Each run is a fresh interpreter that imports the gateway's HTTP app and the Ray backend (the
modules ``tandem serve`` loads in the gateway process), builds the FastAPI app over a
``NullBackend``, and reports wall seconds for that, its peak RSS (``ru_maxrss``) and whether
``torch`` is loaded. Like ``tandem serve``, it first bars torch where the checkout has
``cluster.gateway.torch_free`` (the old layout has none). The tokenizer is the built-in ``tiny`` model's, loaded the
way the gateway loads a model's (``AutoTokenizer.from_pretrained``). The gateway's RSS while serving (idle and after N requests)
comes from ``benchmarks/soak.py`` (``--num-requests 1000``), which samples it in the serving
process. Medians of ``--runs``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import checkout  # noqa: E402  (benchmarks/checkout.py)

# (app module, backend module, null backend module) per layout, without the ``tandem.``
# prefix that checkouts with setup.py install under: today's first
LAYOUTS = (
    ("cluster.gateway.app", "cluster.disagg.ray_backend", "cluster.gateway.null_backend"),
    ("cluster.gateway", "cluster.ray_backend", "cluster.null_backend"),
)

CHILD = r"""
import importlib, json, resource, sys, time
app_mod, backend_mod, null_mod, tokenizer_dir = sys.argv[1:5]
start = time.perf_counter()
for torch_free in ("tandem.cluster.gateway.torch_free", "cluster.gateway.torch_free"):
    try:  # what `tandem serve` does first in its process, where the checkout has it
        importlib.import_module(torch_free).bar_torch()
        break
    except ImportError:
        pass
app = importlib.import_module(app_mod)
importlib.import_module(backend_mod)
null = importlib.import_module(null_mod)
imported = time.perf_counter() - start
from transformers import AutoTokenizer  # what the gateway loads for --model tiny
app.create_app(null.NullBackend(AutoTokenizer.from_pretrained(tokenizer_dir)))
built = time.perf_counter() - start
print(json.dumps({
    "import_s": imported,
    "app_s": built,
    "max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    "torch": sys.modules.get("torch") is not None,
    "modules": len(sys.modules),
}))
"""


def layout_of(root: str) -> tuple[str, str, str]:
    for layout in LAYOUTS:
        if all(
            os.path.exists(os.path.join(root, *m.split(".")) + ".py")
            or os.path.exists(os.path.join(root, *m.split("."), "__init__.py"))
            for m in layout
        ):
            return tuple(checkout.module(root, m) for m in layout)
    raise SystemExit(f"no known gateway layout under {root}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--root", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    p.add_argument("--runs", type=int, default=5)
    args = p.parse_args()
    root = os.path.abspath(args.root)
    layout = layout_of(root)
    env = checkout.python_env(root)
    tokenizer_dir = (
        subprocess.run(  # the built-in tiny model's directory (written once)
            [
                sys.executable,
                "-c",
                f"try:\n from {checkout.module(root, 'workers')}.checkpoints.tiny import "
                "ensure_tiny_model as e\n"
                "except ImportError:\n from workers.tiny import ensure_tiny_model as e\nprint(e())",
            ],
            cwd=root,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            check=True,
        )
        .stdout.strip()
        .splitlines()[-1]
    )
    runs = []
    for _ in range(args.runs):
        done = subprocess.run(
            [sys.executable, "-c", CHILD, *layout, tokenizer_dir],
            cwd=root,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        if done.returncode != 0:
            print(done.stderr[-3000:], file=sys.stderr)
            return 1
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    med = {k: statistics.median(r[k] for r in runs) for k in ("import_s", "app_s", "max_rss_mib")}
    print(f"checkout: {root}; modules {', '.join(layout)}; {args.runs} runs, medians")
    print(f"  import of app + backend   {med['import_s']:.2f} s")
    print(f"  app built (NullBackend)   {med['app_s']:.2f} s")
    print(f"  peak RSS                  {med['max_rss_mib']:.0f} MiB")
    print(f"  torch imported            {runs[0]['torch']}")
    print(f"  modules loaded            {runs[0]['modules']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
