"""Serving benchmarks, both tables in one run:

1. gateway overhead  (benchmarks/serve_gateway.py): SSE tokens/s through the
   gateway with a null model vs a bare uvicorn SSE endpoint;
2. interference      (benchmarks/serve_interference.py): decode ITL under
   long prompts, 1 prefill + 1 decode vs 2 colocated engines.

Run: python benchmarks/serve.py
"""

import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

if __name__ == "__main__":
    for script in ("serve_gateway.py", "serve_interference.py"):
        print(f"== {script}", flush=True)
        subprocess.run([sys.executable, os.path.join(HERE, script)], check=True)
