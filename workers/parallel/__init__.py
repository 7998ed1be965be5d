"""Tensor parallelism: one engine, one scheduler, N workers each holding 1/N of
the weights and of the KV cache, joined by torch.distributed (gloo on CPU,
NCCL on CUDA).

    plan.py           what rank r holds (heads, KV heads, MLP columns, vocab rows)
    group.py          the process group and the collectives the layers call
    layers.py         row-parallel / vocab-parallel layers swapped into a model
    loading.py        a rank's weights read as checkpoint slices
    messages.py       engine core <-> worker messages, WorkerSpec, WorkerFailed
    executor.py       rank 0 in the engine core: start workers, drive steps
    worker.py         ranks 1..N-1: a process running ModelRunner on its shard
    connector_hook.py where a rank > 0 gets its own KV connector worker side
"""
