"""Two processes for KV READ benchmarks: a prefill connector in a child
process, a decode connector in this one, the KV caches on one device.

Shared by ``benchmarks/kv_transfer.py`` and ``benchmarks/gpu_nixl.py``::

    child (tests/kvtransfer/prefill_process.py)    this process (ReadPair)
    P: KV of known content (seeded) on device  <--  D: connector pulls (scheduler side
       hands out params, frees on "done"            -> metadata -> worker -> NIXL READ)
                                                    raw READs through D's own agent
                                                    device copies of the same bytes

Timing helpers synchronise the device before reading the clock, so a GPU
copy or READ is timed to its end, not to its launch.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

# [blocks, layers, K/V, block_size, kv heads, head dim] fp32: 512 KiB per block, the
# bytes of one block of a Llama-3.2-1B-shaped model in bf16 (16 layers, 8 x 64)
BLOCK_SIZE = 16
NUM_BLOCKS = 1024
BLOCK_SHAPE = (8, 2, BLOCK_SIZE, 8, 64)
SEED = 0
POLL_S = 50e-6  # default wait between checks of a READ in flight


def no_device_message(device: str) -> str | None:
    """Why ``device`` cannot be used here, or None when it can."""
    import torch

    if device.startswith("cuda") and not torch.cuda.is_available():
        return "no GPU (torch.cuda.is_available() is False)"
    return None


def device_name(device: str) -> str:
    """The GPU's name for ``cuda[:N]``, else the CPU line of ``_machine``."""
    import torch

    from benchmarks._machine import machine

    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(torch.device(device))
        return f"{props.name}, {props.total_memory / 2**30:.0f} GiB"
    return machine()


def sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize(torch.device(device))


def pick_blocks(rng, num_blocks: int, num_runs: int, limit: int) -> list[int]:
    """``num_blocks`` distinct block ids below ``limit`` in ``num_runs``
    contiguous runs, the runs not in address order (``num_runs=1``: one run
    at a random place)."""
    num_runs = min(num_runs, num_blocks)
    sizes = [num_blocks // num_runs + (i < num_blocks % num_runs) for i in range(num_runs)]
    slot = limit // num_runs  # one run per slot: runs never overlap
    ids: list[int] = []
    for i, size in enumerate(sizes):
        start = i * slot + int(rng.integers(0, slot - size + 1))
        ids.extend(range(start, start + size))
    order = rng.permutation(num_runs)
    runs, pos = [], 0
    for size in sizes:
        runs.append(ids[pos : pos + size])
        pos += size
    return [b for i in order for b in runs[i]]


def median_gbs(num_bytes: int, seconds: list[float]) -> float:
    return num_bytes / statistics.median(seconds) / 1e9


class ReadPair:
    """A prefill process and this process's decode connector, handshaked.

    ``config`` is shared by both ``KVTransferConfig``s (plus ``device``);
    the KV caches are ``(num_blocks, *block_shape)`` fp32 on ``device``.
    ``close()`` stops the child and the connector."""

    def __init__(
        self,
        config: dict[str, Any],
        device: str = "cpu",
        num_blocks: int = NUM_BLOCKS,
        block_shape: tuple[int, ...] = BLOCK_SHAPE,
        seed: int = SEED,
        prefill_poll_interval_s: float = 0.0001,
        poll_s: float = POLL_S,
    ) -> None:
        import torch

        from tandem.kvtransfer import KVTransferConfig, create_connector
        from tests.kvtransfer.prefill_process import PrefillProcess

        self.device = device
        self.poll_s = poll_s  # D's wait between checks of a READ (connector and raw)
        self.shape = (num_blocks, *block_shape)
        self.seed = seed
        config = {"block_size": block_shape[2], **config, "device": device}
        self.prefill = PrefillProcess(
            {"engine_id": "bench-p", **config}, self.shape, seed, prefill_poll_interval_s
        )
        try:
            self.scheduler, self.worker = create_connector(
                KVTransferConfig(role="decode", engine_id="bench-d", **config)
            )
            self.kv = torch.zeros(self.shape, device=device)
            self.worker.register_kv_caches(self.kv)
            self.scheduler.set_prefill_endpoints([self.prefill.endpoint])
        except BaseException:
            self.prefill.close()
            raise
        self.block_bytes = self.kv[0].numel() * self.kv.element_size()

    def expected(self):
        """P's KV (the child's seeded content) on this device."""
        from tests.kvtransfer.prefill_process import kv_content

        return kv_content(self.shape, self.seed).to(self.device)

    def finish(self, request_id: str, remote_block_ids: list[int]) -> dict:
        """P finishes a prefill whose KV is ``remote_block_ids``: its params."""
        num_tokens = len(remote_block_ids) * self.shape[3]
        return self.prefill.finish(request_id, num_tokens, remote_block_ids)

    def pull(self, request_id: str, params: dict, block_ids: list[int]) -> None:
        """D loads ``params``' blocks into ``block_ids`` through both connector
        halves, as an engine does; returns once the load is received."""
        self.pull_many([(request_id, params, block_ids)])

    def pull_many(self, loads: list[tuple[str, dict, list[int]]]) -> None:
        """``(request_id, params, block_ids)`` loads started in one engine
        step (one connector metadata); returns once all are received."""
        from tandem.scheduler.messages import KVConnectorOutput
        from tandem.scheduler.request import Request, RequestStatus
        from tandem.wire.engine_protocol import SamplingParams

        requests = []
        for request_id, params, block_ids in loads:
            num_tokens = params["num_tokens"]
            req = Request(
                request_id, [0] * (num_tokens + 1), SamplingParams(), kv_transfer_params=params
            )
            num_external, _ = self.scheduler.get_num_new_matched_tokens(req, 0)
            self.scheduler.update_state_after_alloc(req, block_ids, num_external)
            requests.append((req, block_ids))
        self.worker.start_load_kv(self.scheduler.build_connector_meta(None))
        waiting = {request_id for request_id, _, _ in loads}
        deadline = time.monotonic() + 60
        while waiting:
            waiting -= self.worker.get_finished()[1]
            if time.monotonic() > deadline:
                raise TimeoutError(sorted(waiting))
            if waiting:
                time.sleep(self.poll_s)  # poll like an engine loop; leave P a core
        if self.worker.get_block_ids_with_load_errors():
            raise RuntimeError(f"a load of {[r for r, _, _ in loads]} failed")
        done = [request_id for request_id, _, _ in loads]
        self.scheduler.update_connector_output(KVConnectorOutput(finished_recving=done))
        for req, block_ids in requests:
            req.status = RequestStatus.FINISHED_STOPPED
            self.scheduler.request_finished(req, block_ids)

    def descriptors(self, block_ids: list[int], remote_block_ids: list[int]):
        """The descriptors the connector posts for this whole-block load
        (``tp_plan.read_descriptors``, absolute addresses)."""
        from tandem.kvtransfer.tp_plan import BlockGeometry, HeadRead, read_descriptors

        peer = self._peer()
        shard, layout = self.worker.shard, self.worker.layout
        assert shard is not None and layout is not None and self.worker.agent.region is not None
        geometry = BlockGeometry(
            layout.layout,
            layout.num_layers,
            layout.block_size,
            layout.head_dim,
            self.kv.element_size(),
        )
        read = HeadRead(0, shard.head_start, shard.num_heads)
        return read_descriptors(
            geometry,
            shard,
            shard,
            read,
            block_ids,
            remote_block_ids,
            self.worker.agent.region.base_addr,
            peer[1].base_addr,
        )

    def raw_read_s(self, *descs) -> float:
        """Seconds of READs of ``descs`` (one READ each, all posted, then
        waited for) through D's agent: NIXL only, no planning, no connector;
        from the first post to the last completion, polled every ``poll_s``."""
        peer_name, region = self._peer()
        agent = self.worker.agent
        sync(self.device)
        start = time.perf_counter()
        posted = [agent.start_read(peer_name, region, d) for d in descs]
        states = [state for _, state in posted]
        while "PROC" in states:
            time.sleep(self.poll_s)
            states = [s if s != "PROC" else agent.check(h) for (h, _), s in zip(posted, states)]
        elapsed = time.perf_counter() - start
        for handle, _ in posted:
            agent.release(handle)
        if any(state != "DONE" for state in states):
            raise RuntimeError(f"raw READs ended {states}")
        return elapsed

    def _peer(self):
        peer = self.worker.ready_peer(self.prefill.engine_id, self.prefill.epoch)
        if peer is None:
            raise RuntimeError("no handshake with the prefill process yet: pull once first")
        return peer

    def close(self) -> None:
        try:
            self.worker.shutdown()
        finally:
            self.prefill.close()


def timed_copy_s(dst, src, block_ids: list[int], src_block_ids: list[int], device: str) -> float:
    """Seconds to copy blocks ``src[src_block_ids[i]]`` into ``dst[block_ids[i]]``
    with ``Tensor.copy_``, one copy per run, on ``device`` (synchronised)."""
    from tandem.kvtransfer.nixl_agent import split_block_runs

    sync(device)
    start = time.perf_counter()
    for local, remote, n in split_block_runs(block_ids, src_block_ids):
        dst[local : local + n].copy_(src[remote : remote + n])
    sync(device)
    return time.perf_counter() - start
