"""Compile the Triton kernels for a real GPU with no GPU at hand (ahead of time, to cubin).

The interpreter runs kernels as NumPy and hides what only the compiler sees: type errors in
``tl.dot`` operands, layouts, a loop the pipeliner cannot handle, shared memory beyond the
device's. Here each kernel launch the model code makes is recorded (the kernel is not run),
then compiled for a CUDA target with Triton's own argument specialization and ptxas::

    with recording() as launches:
        model(ids, positions, kv_cache, meta)        # CPU tensors, TANDEM_FORCE_TRITON=1
    for launch in unique(launches):
        compile_for(launch, SM90)                    # -> cubin + shared-memory bytes

Runs in a process of its own, never inside a pytest run that also interprets kernels: Triton
decides at import whether ``triton.jit`` (its standard library too) compiles or interprets,
and the interpreter patches ``triton.language`` while it runs; one process cannot do both.

A CPU launch picks the interpreter's variant of the attention kernel (``INTERPRETED``,
``DOT_FP32``); ``cuda_constexprs`` swaps in what a CUDA tensor picks. Uses Triton internals
(``create_function_from_signature``, ``JITFunction._pack_args``, the path ``JITFunction.run``
takes to compile); ``aot_unavailable`` says why when an installed Triton lacks them.

    .venv/bin/python -m tests.kernels.triton_aot          # the whole matrix, a table (~4 min)
    .venv/bin/python -m tests.kernels.triton_aot --json   # the CI subset, JSON (~20 s)

The whole matrix: every shape in ``SHAPES``, three dtypes, both KV layouts, sm_90 and sm_80.
``tests/kernels/test_triton_compile.py`` runs the CI subset and checks its results.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

KERNEL_MODULES = (
    "tandem.kernels.triton_attention",
    "tandem.kernels.triton_cache",
    "tandem.kernels.triton_norm",
    "tandem.kernels.triton_rope_cache",
    "tandem.kernels.triton_activation",
)
# (arch, warp size, opt-in shared memory per block in bytes) of the targets checked
SM90 = (90, 32, 232448)  # H100 / H200
SM80 = (80, 32, 166912)  # A100
TARGETS = {"sm_90": SM90, "sm_80": SM80}

BLOCK = 16
MIXED = [(40, 40), (17, 1), (70, 6), (5, 1)]  # (seq_len, query_len): a prefill, decodes, a chunk
DECODE = [(30, 1), (9, 1), (100, 1)]
STEP_KINDS = ("mixed", "decode", "graph")  # graph: a decode bucket over the int32 static buffers

# name -> (HF architecture, config): the tests' tiny checkpoints, then real models' shapes
SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "tiny-llama": ("LlamaForCausalLM", dict(hidden_size=64, num_attention_heads=4,
                   num_key_value_heads=2, intermediate_size=128)),
    "tiny-qwen3-hd24-bias": ("Qwen3ForCausalLM", dict(hidden_size=64, num_attention_heads=4,
                             num_key_value_heads=2, intermediate_size=128, head_dim=24,
                             attention_bias=True)),
    "llama-hd80-mqa": ("LlamaForCausalLM", dict(hidden_size=640, num_attention_heads=8,
                       num_key_value_heads=1, intermediate_size=1024)),
    "llama-3.2-1b": ("LlamaForCausalLM", dict(hidden_size=2048, num_attention_heads=32,
                     num_key_value_heads=8, intermediate_size=8192)),
    "qwen2.5-0.5b": ("Qwen2ForCausalLM", dict(hidden_size=896, num_attention_heads=14,
                     num_key_value_heads=2, intermediate_size=4864)),
    "qwen3-0.6b": ("Qwen3ForCausalLM", dict(hidden_size=1024, num_attention_heads=16,
                   num_key_value_heads=8, intermediate_size=3072, head_dim=128)),
}  # fmt: skip


@dataclass
class Launch:
    kernel: Any  # triton.runtime.jit.JITFunction
    args: tuple
    kwargs: dict[str, Any]

    @property
    def name(self) -> str:
        return self.kernel.fn.__name__


@dataclass
class Compiled:
    name: str
    signature: dict[str, str]
    constexprs: dict[str, Any]
    shared_bytes: int
    num_warps: int
    cubin_bytes: int


def aot_unavailable() -> str | None:
    """Why ahead-of-time compilation cannot run with the installed Triton, or None."""
    try:
        import triton
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.compiler import ASTSource, make_backend  # noqa: F401
        from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: F401
    except ImportError as exc:
        return f"triton {getattr(sys.modules.get('triton'), '__version__', '?')}: {exc}"
    if not hasattr(JITFunction, "_pack_args"):
        return f"triton {triton.__version__} has no JITFunction._pack_args"
    from triton.backends.nvidia import compiler

    try:
        try:
            compiler.get_ptxas_version(SM90[0])
        except TypeError:  # older Triton: one ptxas for every arch
            compiler.get_ptxas_version()
    except Exception as exc:  # noqa: BLE001 - any failure to run ptxas means no cubin here
        return f"triton {triton.__version__}: its bundled ptxas does not run here ({exc})"
    return None


@contextlib.contextmanager
def recording() -> Iterator[list[Launch]]:
    """Every kernel launch in the block is recorded instead of run (outputs stay empty)."""
    launches: list[Launch] = []
    kernels = []
    for name in KERNEL_MODULES:
        module = importlib.import_module(name)
        for value in vars(module).values():
            if type(value).__name__ == "JITFunction" and value.__module__ == name:
                kernels.append(value)
    if not kernels:
        raise RuntimeError("no JITFunction kernels: TRITON_INTERPRET was set at import")

    def recorder(kernel):
        def run(*args, grid, warmup, **kwargs):
            launches.append(Launch(kernel, args, dict(kwargs)))

        return run

    for kernel in kernels:
        kernel.run = recorder(kernel)  # instance attribute: __getitem__ calls self.run
    try:
        yield launches
    finally:
        for kernel in kernels:
            del kernel.run


def cuda_constexprs(launch: Launch) -> Launch:
    """The launch as a CUDA tensor would make it (the attention wrapper picks the
    interpreter's loop and fp32 dots for CPU tensors)."""
    kwargs = dict(launch.kwargs)
    if "INTERPRETED" in kwargs:
        cache = launch.args[2]
        kwargs["INTERPRETED"] = False
        kwargs["DOT_FP32"] = str(cache.dtype) == "torch.float32"
    return Launch(launch.kernel, launch.args, kwargs)


def _specialize(launch: Launch, backend: Any) -> tuple[Any, dict, dict, dict]:
    from triton.runtime.jit import create_function_from_signature

    fn = launch.kernel
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*launch.args, **launch.kwargs)
    return fn._pack_args(backend, launch.kwargs, bound, specialization, options)


def specialization_key(launch: Launch, arch: tuple[int, int, int] = SM90) -> str:
    """What Triton would compile separately (signature, constexprs, alignment)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend

    backend = make_backend(GPUTarget("cuda", arch[0], arch[1]))
    _, signature, constexprs, attrs = _specialize(launch, backend)
    return repr((launch.name, sorted(signature.items()), sorted(constexprs.items()), attrs))


def unique(launches: list[Launch], arch: tuple[int, int, int] = SM90) -> list[Launch]:
    seen: dict[str, Launch] = {}
    for launch in launches:
        seen.setdefault(specialization_key(launch, arch), launch)
    return list(seen.values())


def compile_for(launch: Launch, arch: tuple[int, int, int] = SM90) -> Compiled:
    """Compile ``launch``'s specialization to a cubin for ``arch``; raises what Triton
    raises (a compile error) and ValueError when the kernel needs more shared memory than
    one block of that GPU may have (the launch would fail with 'out of resource')."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend

    target = GPUTarget("cuda", arch[0], arch[1])
    backend = make_backend(target)
    options, signature, constexprs, attrs = _specialize(launch, backend)
    fn = launch.kernel
    src = ASTSource(fn, signature, constexprs, attrs)
    kernel = triton.compile(src, target=target, options=options.__dict__)
    cubin = kernel.asm.get("cubin")
    if not cubin:
        raise RuntimeError(f"{launch.name}: no cubin for sm_{arch[0]}")
    shared = int(kernel.metadata.shared)
    named = {fn.arg_names[path[0]]: value for path, value in constexprs.items()}
    if shared > arch[2]:
        raise ValueError(
            f"{launch.name} {named}: {shared} bytes of shared memory, more than the "
            f"{arch[2]} one block may use on sm_{arch[0]}"
        )
    return Compiled(
        launch.name, dict(signature), named, shared, kernel.metadata.num_warps, len(cubin)
    )


# ---- model launches ------------------------------------------------------------------


def _model(arch: str, fields: dict[str, Any], dtype: Any) -> Any:
    import transformers

    from tandem.workers.models import MODEL_REGISTRY

    model_type = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}.get(arch, "qwen3")
    config_cls = transformers.AutoConfig.for_model(model_type).__class__
    config = config_cls(vocab_size=64, num_hidden_layers=1, max_position_embeddings=512, **fields)
    return MODEL_REGISTRY[arch](config, dtype).eval()


def _tables(seqs: list[tuple[int, int]]) -> list[list[int]]:
    width = max(-(-s // BLOCK) for s, _ in seqs)
    return [[i * width + j for j in range(-(-s // BLOCK))] for i, (s, _) in enumerate(seqs)]


def record_model_launches(
    shape: str, dtypes: tuple, kinds: tuple[str, ...] = STEP_KINDS, layout: str = "blocks_first"
) -> list[Launch]:
    """The kernel launches of one model forward per step kind and dtype, as CUDA tensors
    would make them. Needs ``TANDEM_FORCE_TRITON=1`` (``_start`` sets it)."""
    import torch

    from tandem.kernels import AttentionMetadata
    from tandem.workers.graphs.static_inputs import StaticDecodeInputs
    from tandem.workers.runner.kv_cache import allocate_kv_cache

    arch, fields = SHAPES[shape]
    cpu = torch.device("cpu")
    launches: list[Launch] = []
    for dtype in dtypes:
        model = _model(arch, fields, dtype)
        kv = allocate_kv_cache(64, 1, BLOCK, model.num_kv_heads, model.head_dim, dtype, cpu, layout)
        with recording() as recorded, torch.inference_mode():
            for kind in kinds:
                if kind == "graph":  # a bucket of 4 rows, 3 real (workers/graphs/)
                    inputs = StaticDecodeInputs(4, 8, BLOCK, cpu)
                    inputs.fill([1, 2, 3], [29, 8, 99], _tables(DECODE), [30, 9, 100], 4)
                    ids = inputs.device_view("input_ids", 4)
                    model(ids, inputs.device_view("positions", 4), kv, inputs.metadata(4))
                    continue
                seqs = MIXED if kind == "mixed" else DECODE
                meta = AttentionMetadata.build(
                    _tables(seqs), [s for s, _ in seqs], [q for _, q in seqs], BLOCK
                )
                ids = torch.zeros(meta.num_query_tokens, dtype=torch.long)
                model(ids, ids.clone(), kv, meta)
        if not recorded:
            raise RuntimeError(f"{shape}: the forward launched no Triton kernel")
        launches += recorded
    return [cuda_constexprs(launch) for launch in launches]


def _start() -> str | None:
    """Prepare this process to compile (not interpret); why it cannot, or None."""
    os.environ.pop("TRITON_INTERPRET", None)
    os.environ["TANDEM_FORCE_TRITON"] = "1"
    if "triton" in sys.modules and "tandem.kernels.triton_attention" in sys.modules:
        kernel = sys.modules["tandem.kernels.triton_attention"]._paged_attention_kernel
        if type(kernel).__name__ != "JITFunction":
            raise RuntimeError("the kernels were imported interpreted: run in a fresh process")
    return aot_unavailable()


def _describe(compiled: Compiled) -> dict[str, Any]:
    return {
        "name": compiled.name,
        "signature": compiled.signature,
        "constexprs": {k: v for k, v in compiled.constexprs.items() if _jsonable(v)},
        "shared_bytes": compiled.shared_bytes,
        "cubin_bytes": compiled.cubin_bytes,
    }


def _jsonable(value: Any) -> bool:
    return isinstance(value, (bool, int, float, str)) or value is None


# The CI subset: case -> (shape, dtypes, step kinds, kernels kept or None for all)
CI_ALL = ("float32", "bfloat16", "float16")
CI_CASES: dict[str, tuple[str, tuple[str, ...], tuple[str, ...], tuple[str, ...] | None]] = {
    "llama-3.2-1b": ("llama-3.2-1b", CI_ALL, STEP_KINDS, None),
    **{
        shape: (
            shape,
            ("float32", "bfloat16") if shape == "llama-hd80-mqa" else ("bfloat16",),
            ("mixed", "decode"),
            ("_paged_attention_kernel", "_rope_write_kv_kernel")
            + (("_rms_norm_kernel",) if "qwen3" in shape else ()),
        )
        for shape in ("tiny-llama", "tiny-qwen3-hd24-bias", "llama-hd80-mqa", "qwen2.5-0.5b",
                      "qwen3-0.6b")
    },
}  # fmt: skip


def _kv_write_launches() -> list[Launch]:
    import torch

    from tandem.kernels import triton_cache

    with recording() as recorded:
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            key = torch.zeros(7, 8, 64, dtype=dtype)
            cache = torch.zeros(16, 3, 2, BLOCK, 8, 64, dtype=dtype)[:, 1]  # a layer's view
            for slots in (torch.arange(7), torch.arange(7, dtype=torch.int32)):
                triton_cache.write_kv_cache(key, key.clone(), cache, slots)
    return recorded


def _bad_kernel_error() -> str | None:
    """What the compiler says of a kernel it must refuse (a float offset on a pointer)."""
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def bad_kernel(x_ptr, N: tl.constexpr):
        offsets = tl.arange(0, N).to(tl.float32)
        tl.store(x_ptr + offsets, 1.0)

    try:
        compile_for(Launch(bad_kernel, (torch.zeros(16),), {"N": 16}), SM90)
    except Exception as exc:  # noqa: BLE001 - the message is the result
        return f"{type(exc).__name__}: {exc}"
    return None


def run_ci() -> dict[str, Any]:
    """The CI subset compiled for sm_90: per case, every distinct specialization's
    signature, constexprs and shared memory, or the error it raised."""
    import torch
    import triton

    result: dict[str, Any] = {"triton": triton.__version__, "unavailable": _start()}
    if result["unavailable"] is not None:
        return result
    cases: dict[str, Any] = {}
    for case, (shape, dtype_names, kinds, keep) in CI_CASES.items():
        dtypes = tuple(getattr(torch, name) for name in dtype_names)
        launches = record_model_launches(shape, dtypes, kinds)
        if keep is not None:
            launches = [launch for launch in launches if launch.name in keep]
        cases[case] = _compile_case(launches)
    cases["kv-write"] = _compile_case(_kv_write_launches())
    result["cases"] = cases
    result["bad_kernel_error"] = _bad_kernel_error()
    return result


def _compile_case(launches: list[Launch]) -> list[dict[str, Any]]:
    out = []
    for launch in unique(launches):
        try:
            out.append(_describe(compile_for(launch, SM90)))
        except Exception as exc:  # noqa: BLE001 - reported per specialization
            out.append({"name": launch.name, "error": f"{type(exc).__name__}: {exc}"[:2000]})
    return out


def main(argv: list[str]) -> int:
    """``--json``: the CI subset as JSON on stdout. Else the whole matrix as a table; exit
    1 on a failure."""
    if argv[1:] == ["--json"]:
        print(json.dumps(run_ci()))
        return 0
    import time

    import torch

    reason = _start()
    if reason is not None:
        print(f"no Triton AOT compile here: {reason}")
        return 0
    import triton

    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    failures = 0
    print(f"triton {triton.__version__}, torch {torch.__version__}")
    print(f"{'target':<6} {'shape':<22} {'kernel':<24} {'smem B':>7}  signature dtypes; constexprs")
    launches = []
    for shape in SHAPES:
        for layout in ("blocks_first", "head_major"):
            launches += [(shape, x) for x in record_model_launches(shape, dtypes, layout=layout)]
    launches += [("kv-write", x) for x in _kv_write_launches()]
    for target_name, target in TARGETS.items():
        start = time.perf_counter()
        seen: set[str] = set()
        for shape, launch in launches:
            key = specialization_key(launch, target)
            if key in seen:
                continue
            seen.add(key)
            try:
                c = compile_for(launch, target)
            except Exception as exc:  # noqa: BLE001 - reported, then counted
                failures += 1
                print(f"{target_name:<6} {shape:<22} {launch.name:<24} FAILED: {exc}")
                continue
            ptrs = sorted({v for v in c.signature.values() if v.startswith("*")})
            print(
                f"{target_name:<6} {shape:<22} {c.name:<24} {c.shared_bytes:>7}  "
                f"{','.join(ptrs)}; {c.constexprs}"
            )
        print(f"{target_name}: {len(seen)} specializations in {time.perf_counter() - start:.0f} s")
    print(f"{failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
