"""Does an engine stay inside ``--gpu-memory-utilization`` in each CUDA graph mode? (CUDA)

    python3 benchmarks/gpu_graph_memory.py [--gpu-memory-utilization 0.45]

One engine per mode on the 1B-shaped checkpoint (bf16), started alone on the GPU. Printed
per mode: what the device lost while the engine started (free memory before minus after,
the CUDA context included), its share (utilization x total), torch's reservation, what lies
outside torch (the context, NIXL/UCX, the driver's executable graphs), and the graph memory
the start-up profile reserved for (``step_memory.graph_bytes``) against the real capture's
(``graphs.num_bytes``). ``full_and_piecewise`` became the candidate default when a half-GPU
P/D test ran out of memory in it (docs/gpu.md): this shows whether its graphs fit the share.
Without CUDA it says so and exits 0.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.gpu_engine import _release, make_1b_checkpoint, no_gpu_message  # noqa: E402

MODES = ("none", "decode", "full_and_piecewise")
GIB = 2**30


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.45)
    ap.add_argument("--modes", default=",".join(MODES))
    args = ap.parse_args()
    if (why := no_gpu_message()) is not None:
        print(why)
        return
    from tandem.workers.config import EngineConfig
    from tandem.workers.engine.core import EngineCore

    path = make_1b_checkpoint(tempfile.mkdtemp())
    total = torch.cuda.get_device_properties(0).total_memory
    share = args.gpu_memory_utilization * total
    print(f"{torch.cuda.get_device_name(0)}: {total / GIB:.1f} GiB; share "
          f"{args.gpu_memory_utilization} = {share / GIB:.2f} GiB")  # fmt: skip
    print("| mode | device lost GiB | lost / share | torch reserved GiB | outside torch GiB "
          "| graphs profiled MiB | graphs real MiB | KV blocks |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for mode in args.modes.split(","):
        _release()
        free_before = torch.cuda.mem_get_info()[0]
        reserved_before = torch.cuda.memory_reserved()
        engine = EngineCore(
            EngineConfig.from_flat(
                model=path,
                device="cuda",
                dtype="bfloat16",
                max_num_seqs=256,
                gpu_memory_utilization=args.gpu_memory_utilization,
                cuda_graph_mode=mode,
            )
        )
        torch.cuda.synchronize()
        lost = free_before - torch.cuda.mem_get_info()[0]
        reserved = torch.cuda.memory_reserved() - reserved_before
        profiled = engine.step_memory.graph_bytes
        real = engine.graphs.num_bytes
        print(f"| {mode} | {lost / GIB:.2f} | {lost / share:.3f} | {reserved / GIB:.2f} | "
              f"{(lost - reserved) / GIB:.2f} | {profiled / 2**20:.0f} | {real / 2**20:.0f} | "
              f"{engine.sched_config.num_kv_blocks} |",
              flush=True)  # fmt: skip
        engine.shutdown()
        del engine


if __name__ == "__main__":
    main()
