"""Two engines on one GPU, half of it each, started together: where does the memory go? (CUDA)

    python3 benchmarks/gpu_pd_memory.py [--modes decode,full_and_piecewise] [--stagger-s 0]

The set-up of ``tests/gpu/test_cuda_pd_half_gpu.py`` (``tandem serve --prefill 1 --decode 1
--num-gpus-per-engine 0.5``: 0.45 of the GPU each, KV over NIXL in VRAM), one CUDA graph mode
at a time. Each engine runs in its own process with INFO logs (prefixed by its role and the
milliseconds since it started), so its start-up says what it measured: the activation peak,
the profiling capture, the KV budget, the real capture against the profiled. The parent
samples the device's free memory every 20 ms while both start and prints the lowest it saw
and when; each engine then reports its torch reservation, its KV cache, its graphs (profiled
and real), the device memory it holds outside torch, and its start-up transport probe (which
starts two more CUDA processes as soon as the KV cache is registered, while the graphs are
still being captured). ``--stagger-s``: start the decode engine that long after the prefill
engine (0: together, as the test does; several values: one run each). Where NVML is there
(nvidia-ml-py), also: the device memory the CUDA context and torch's CUDA state took (NVML's
device-wide used memory before and after, clean when the engines start apart), and this
engine's own used memory as NVML lists it by process id (n/a where NVML does not list the
process, e.g. in a container with its own process ids).

The half-GPU test failed in ``full_and_piecewise`` (its probe hit ``out of memory``) and
passes in ``decode``; one engine alone stays inside its share in every mode
(``gpu_graph_memory.py``). This shows where two engines started together lose the room.
Without CUDA it says so and exits 0.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

GIB = 2**30
MIB = 2**20
# the half-GPU test's model: 2 layers, hidden 1024, fp32 (256 KiB per KV block)
SHAPE = dict(hidden_size=1024, num_attention_heads=8, num_key_value_heads=8, intermediate_size=1024)


def _configs(path: str, mode: str) -> dict:
    from tandem.cluster.cli.main import build_parser
    from tandem.cluster.cli.settings import pool_specs, resolve_config

    argv = ["serve", "--model", path, "--prefill", "1", "--decode", "1"]
    argv += ["--num-gpus-per-engine", "0.5", "--device", "cuda", "--dtype", "float32"]
    argv += ["--max-num-batched-tokens", "64", "--max-num-seqs", "8", "--cuda-graph-mode", mode]
    specs = {s.role: s for s in pool_specs(resolve_config(build_parser().parse_args(argv)))}
    return {"P": specs["prefill"].config, "D": specs["decode"].config}


def _nvml_used() -> int | None:
    """Device-wide used bytes from NVML (no CUDA context needed); None without NVML."""
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).used
    except Exception:  # noqa: BLE001 - a diagnostic: no NVML, no figure
        return None


def _nvml_processes() -> list[tuple[int, int]] | None:
    """(pid, used bytes) of every compute process NVML lists on device 0."""
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        return [(p.pid, p.usedGpuMemory or 0)
                for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)]  # fmt: skip
    except Exception:  # noqa: BLE001
        return None


def _nvml_process(pid: int) -> int | None:
    return next((used for p, used in _nvml_processes() or [] if p == pid), None)


def _engine(role: str, config, delay_s: float, results, done) -> None:
    start = time.monotonic()
    logging.basicConfig(
        level=logging.INFO,
        format=f"[{role} %(relativeCreated)6.0f ms] %(name)s: %(message)s",
        stream=sys.stdout,
    )
    logging.getLogger("nixl").setLevel(logging.WARNING)
    time.sleep(delay_s)
    used_start = _nvml_used()  # before this process has a CUDA context
    import torch

    torch.set_num_threads(1)
    torch.zeros(1, device="cuda")  # the CUDA context and torch's CUDA state
    used_context = _nvml_used()
    from tandem.workers.engine.core import EngineCore

    free_before = torch.cuda.mem_get_info()[0]
    try:
        engine = EngineCore(config)
    except Exception as e:  # noqa: BLE001 - reported to the parent
        results.put({"role": role, "error": f"{type(e).__name__}: {e}"})
        return
    torch.cuda.synchronize()
    up_s = time.monotonic() - start
    free_up, total = torch.cuda.mem_get_info()
    probe = engine.connector_worker._transport_probe  # noqa: SLF001 - a diagnostic
    report = probe.wait(150.0) if probe is not None else None
    kv = engine.kv_cache
    results.put(
        {
            "role": role,
            "up_s": up_s,
            "share": config.cache.gpu_memory_utilization * total,
            "reserved": torch.cuda.memory_reserved(),
            "kv": kv.numel() * kv.element_size(),
            "activation": engine.step_memory.activation_bytes,
            "graphs_profiled": engine.step_memory.graph_bytes,
            "graphs_real": engine.graphs.num_bytes,
            "lost": free_before - free_up,
            "probe": None if report is None else f"{report.transport} {report.warning}".strip(),
            "context": None if used_start is None else used_context - used_start,
            "nvml_self": _nvml_process(os.getpid()),
            "nvml_all": _nvml_processes(),
            "pid": os.getpid(),
        }
    )
    done.wait(120)
    engine.shutdown()


def _mib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / MIB:.0f}"


def _gib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / GIB:.2f}"


def run_mode(path: str, mode: str, stagger_s: float) -> None:
    import torch

    ctx = mp.get_context("spawn")
    results, done = ctx.Queue(), ctx.Event()
    configs = _configs(path, mode)
    total = torch.cuda.get_device_properties(0).total_memory
    lowest = [torch.cuda.mem_get_info()[0], 0.0]
    sampling = threading.Event()
    t0 = time.monotonic()

    def sample() -> None:
        while not sampling.is_set():
            free = torch.cuda.mem_get_info()[0]
            if free < lowest[0]:
                lowest[:] = [free, time.monotonic() - t0]
            time.sleep(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    procs = [
        ctx.Process(target=_engine, args=(role, configs[role], delay, results, done))
        for role, delay in (("P", 0.0), ("D", stagger_s))
    ]
    for p in procs:
        p.start()
    got = []
    deadline = time.monotonic() + 400
    while len(got) < 2 and time.monotonic() < deadline:
        try:
            got.append(results.get(timeout=5))
        except Exception:  # noqa: BLE001 - queue.Empty
            if not all(p.is_alive() for p in procs) and results.empty():
                break
    free_both = torch.cuda.mem_get_info()[0]
    smi = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader"],
        capture_output=True,
        text=True,
    ).stdout.split("\n")
    sampling.set()
    done.set()
    for p in procs:
        p.join(60)
        if p.is_alive():
            p.kill()
    print(f"\n== mode {mode}, stagger {stagger_s:.0f} s: device {total / GIB:.1f} GiB; lowest "
          f"free {lowest[0] / GIB:.2f} GiB at {lowest[1]:.1f} s; free with both up "
          f"{free_both / GIB:.2f} GiB")  # fmt: skip
    print("| engine | up s | share GiB | torch reserved GiB | KV GiB | activations MiB | "
          "graphs profiled MiB | graphs real MiB | device lost GiB | outside torch GiB | "
          "context MiB | NVML this pid GiB | probe |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in sorted(got, key=lambda r: r["role"]):
        if "error" in r:
            print(f"| {r['role']} | failed: {r['error'][:300]} |")
            continue
        print(f"| {r['role']} | {r['up_s']:.1f} | {r['share'] / GIB:.2f} | "
              f"{r['reserved'] / GIB:.2f} | {r['kv'] / GIB:.2f} | {r['activation'] / MIB:.0f} | "
              f"{r['graphs_profiled'] / MIB:.0f} | {r['graphs_real'] / MIB:.0f} | "
              f"{r['lost'] / GIB:.2f} | {(r['lost'] - r['reserved']) / GIB:.2f} | "
              f"{_mib(r['context'])} | {_gib(r['nvml_self'])} | {r['probe']} |")  # fmt: skip
    for r in got:
        if "nvml_all" in r:
            print(f"{r['role']}: pid {r.get('pid')}, NVML processes (pid, GiB): "
                  f"{[(p, round(b / GIB, 2)) for p, b in r['nvml_all'] or []]}")  # fmt: skip
    print(f"parent pid {os.getpid()}; nvidia-smi compute apps with both up: "
          f"{[line for line in smi if line.strip()]}")  # fmt: skip
    if len(got) < 2:
        print(f"only {len(got)} of 2 engines reported (exit codes {[p.exitcode for p in procs]})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", default="decode,full_and_piecewise")
    ap.add_argument("--stagger-s", type=float, nargs="+", default=[0.0])
    args = ap.parse_args()
    from benchmarks.gpu_engine import no_gpu_message

    if (why := no_gpu_message()) is not None:
        print(why)
        return
    from tests.workers.hf_checkpoints import make_checkpoint

    path = make_checkpoint("llama", os.path.join(tempfile.mkdtemp(), "ckpt"), **SHAPE)
    for stagger_s in args.stagger_s:
        for mode in args.modes.split(","):
            run_mode(path, mode, stagger_s)


if __name__ == "__main__":
    main()
