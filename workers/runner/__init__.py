"""The model runner: a ``SchedulerOutput`` in, sampled tokens out.

    model_runner.py   ModelRunner: a step's entry points (launch, finish) and output
    step_planning.py  its host half: per-request copies, each step's plan
    step_forward.py   its device half: layout, forward, sampling, verification
    step_batch.py     a step's plan (loop thread) and its flat batch (where it runs)
    async_step.py     the step stream, launched steps and their results; the
                      overlapped loop (``--async-scheduling``) the engine steps with
    attention.py      the models' attention entry: paged kernels, CPU dense decode
    dense_decode.py   the CPU dense-decode KV copy
    kv_cache.py       KV cache sizing and allocation, its two byte layouts
    cpu_allocator.py  glibc malloc tuning for CPU inference

May import ``kernels``, ``scheduler``, ``wire``, ``kvtransfer.compat`` (KV
layouts), ``workers.sampling`` and ``workers.graphs``; the models import its
attention. Imports torch; this ``__init__`` imports nothing.
"""
