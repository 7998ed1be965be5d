"""Does a lone prompt's prefill step run slower with a third process on the box?

Issue 28's simulator runs found the trace's prompt steps 2.4-6.5 ms slower in
1P2D and 2P1D than in 1P1D, though at 2 req/s every 2P1D prompt goes to
``prefill-0`` and the second prefill engine only idles. This serves the
simulator's lone-prompt probe (``benchmarks/simulator.py``'s 16 lone 256-token
prompts 0.4 s apart, then the same prompts cached) on three set-ups, their
order turning each round:

  1P1D          the simulator's probe as it runs
  2P1D          the same with an idle second prefill engine on the box
  1P1D+waker    the same with a plain process that wakes every 2 ms (about
                an idle engine's wakeups under Ray: 320-470 a second)

and prints P's own prompt step (``RequestTimings``, the median over the 16
prompts) per round and the median over the rounds.

Run: python benchmarks/sim_extra_process.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import simulator as sim  # noqa: E402
from benchmarks._machine import machine  # noqa: E402
from benchmarks._sim_figures import write_probe  # noqa: E402
from benchmarks._sim_idle import p_steps  # noqa: E402

WAKER = "import time\nwhile True:\n    time.sleep(0.002)\n    sum(range(200))\n"
SETUPS = [("1P1D", (1, 1), False), ("2P1D", (2, 1), False), ("1P1D+waker", (1, 1), True)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    import ray

    ray.init(include_dashboard=False, num_cpus=8, log_to_driver=False)
    steps: dict[str, list[float]] = {}
    cached: dict[str, list[float]] = {}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            trace, warmup, probe = (os.path.join(tmp, n) for n in ("t.jsonl", "w.jsonl", "p.jsonl"))
            sim.write_trace(trace, 4, 2.0, 0)
            sim.write_trace(warmup, 6, 4.0, 1000)
            write_probe(probe, sim.PROBE_REQUESTS, 0.4)
            write_probe(probe + ".pairs", sim.PROBE_REQUESTS, 0.4, together=2)
            for r in range(args.rounds):
                k = r % len(SETUPS)
                for name, (pre, dec), waker in SETUPS[k:] + SETUPS[:k]:
                    proc = subprocess.Popen([sys.executable, "-c", WAKER]) if waker else None
                    try:
                        _, probed = sim.serve_and_replay(pre, dec, trace, warmup, probe)
                    finally:
                        if proc is not None:
                            proc.kill()
                            proc.wait()
                    lone = p_steps(probed["rows"]).values()
                    assert {s[0] for s in lone} == {"prefill-0"}
                    steps.setdefault(name, []).append(
                        statistics.median(e - s for _, s, e, _ in lone)
                    )
                    warm = p_steps(probed["cached"]["rows"]).values()
                    cached.setdefault(name, []).append(
                        statistics.median(e - s for _, s, e, _ in warm)
                    )
                    print(
                        f"round {r + 1} {name}: P step {steps[name][-1] * 1e3:.2f} ms", flush=True
                    )
    finally:
        ray.shutdown()
    print("sim_extra_process: a lone 256-token prompt's prefill step (P's own timing)")
    print(f"machine: {machine()}")
    print("| set-up | P step ms per round | median | cached prompt's step ms, median |")
    print("|---|---|---:|---:|")
    for name, xs in steps.items():
        per = " / ".join(f"{x * 1e3:.2f}" for x in xs)
        print(
            f"| {name} | {per} | {statistics.median(xs) * 1e3:.2f} "
            f"| {statistics.median(cached[name]) * 1e3:.2f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
