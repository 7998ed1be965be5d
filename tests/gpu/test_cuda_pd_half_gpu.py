"""Prefill and decode on ONE GPU, half of it each, as ``tandem serve --prefill 1 --decode 1
--num-gpus-per-engine 0.5 --device cuda`` sets them up, minus Ray (the GPU image has none):
the engine configs come from serve's own flag resolution (0.45 of the GPU's memory each, KV
over NIXL), each engine runs in its own process on cuda:0 and sizes its KV cache from its share
(no ``--num-kv-blocks``: both start at once, neither counts the other's share against its
own), the KV goes P -> D over NIXL in VRAM by CUDA IPC, and fp32 greedy tokens through the
handoff equal transformers' on the same GPU. Skipped without CUDA (tests/conftest.py)."""

from __future__ import annotations

import time

import pytest
import torch

from tandem.wire.engine_protocol import SamplingParams
from tests.e2e.engine_proc import Harness
from tests.e2e.test_pd_engines import handoff
from tests.workers.hf_checkpoints import load_hf_model, make_checkpoint
from tests.workers.test_engine import hf_greedy

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

# 2 layers x 2 x 16 slots x 8 KV heads x head dim 128 x fp32 = 256 KiB per block: an 80 GB
# GPU's 0.45 holds ~140k blocks (a smaller model would give the block pools millions)
SHAPE = dict(hidden_size=1024, num_attention_heads=8, num_key_value_heads=8, intermediate_size=1024)
NUM_NEW = 8


def _serve_configs(path: str) -> dict:
    from tandem.cluster.cli.main import build_parser
    from tandem.cluster.cli.settings import pool_specs, resolve_config

    argv = ["serve", "--model", path, "--prefill", "1", "--decode", "1"]
    argv += ["--num-gpus-per-engine", "0.5", "--device", "cuda", "--dtype", "float32"]
    argv += ["--max-num-batched-tokens", "64", "--max-num-seqs", "8"]
    specs = {s.role: s for s in pool_specs(resolve_config(build_parser().parse_args(argv)))}
    assert {role: s.num_gpus for role, s in specs.items()} == {"prefill": 0.5, "decode": 0.5}
    return {"P": specs["prefill"].config, "D": specs["decode"].config}


def test_half_a_gpu_each_prefill_decode_handoff_equals_transformers(tmp_path):
    path = make_checkpoint("llama", tmp_path / "ckpt", **SHAPE)
    configs = _serve_configs(path)
    for config in configs.values():
        assert config.cache.gpu_memory_utilization == pytest.approx(0.45)
        assert config.cache.num_kv_blocks is None and config.kv_transfer.connector == "nixl"
    total = torch.cuda.get_device_properties(0).total_memory
    h = Harness()
    try:
        h.start_all(configs)  # both size their KV caches at the same time
        free, _ = torch.cuda.mem_get_info()
        # both took their 0.45 (weights + KV): under a fifth of the GPU is left
        assert free < 0.2 * total, f"{free / 2**30:.1f} GiB free of {total / 2**30:.1f}"
        g = torch.Generator().manual_seed(3)
        prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (1, 16, 83, 150)]
        sp = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, ignore_eos=True)
        hf = load_hf_model(path).cuda()
        for i, prompt in enumerate(prompts):
            tokens, last, params = handoff(h, f"half-{i}", prompt, sp)
            assert tokens == hf_greedy(hf, prompt, NUM_NEW), f"prompt of {len(prompt)} tokens"
            assert len(params["remote_block_ids"]) == -(-len(prompt) // 16)
        h.wait_idle("P")
        d = h.wait_idle("D")
        deadline = time.monotonic() + 180.0  # the start-up transport probe runs in background
        while not d.kv_transfer.transport and time.monotonic() < deadline:
            time.sleep(0.5)
            d = h.stats("D")
        assert d.kv_transfer.transfer_bytes_total > 0
        assert d.kv_transfer.transfer_failures_total == 0
        assert d.kv_transfer.transport_memory == "VRAM"
        assert "cuda_ipc" in d.kv_transfer.transport, d.kv_transfer
        assert not d.kv_transfer.transport_slow
    finally:
        h.close()
