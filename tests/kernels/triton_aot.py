"""Compile the Triton kernels for a real GPU with no GPU at hand (ahead of time, to cubin).

The interpreter runs kernels as NumPy and hides what only the compiler sees: type errors in
``tl.dot`` operands, layouts, a loop the pipeliner cannot handle, shared memory beyond the
device's. Here each kernel launch the model code makes is recorded (the kernel is not run),
then compiled for a CUDA target with Triton's own argument specialization and ptxas::

    with compiled_kernel_modules(), recording() as launches:
        model(ids, positions, kv_cache, meta)        # CPU tensors, TANDEM_FORCE_TRITON=1
    for launch in unique(launches):
        compile_for(launch, SM90)                    # -> cubin + shared-memory bytes

A CPU launch picks the interpreter's variant of the attention kernel (``INTERPRETED``,
``DOT_FP32``); ``cuda_constexprs`` swaps in what a CUDA tensor picks. Uses Triton internals
(``create_function_from_signature``, ``JITFunction._pack_args``, the path ``JITFunction.run``
takes to compile); ``aot_unavailable`` says why when an installed Triton lacks them.

The whole matrix (every shape in ``SHAPES``, three dtypes, both KV layouts, sm_90 and sm_80)
prints a table: ``.venv/bin/python -m tests.kernels.triton_aot`` (about 2 minutes on 2 cores);
``tests/kernels/test_triton_compile.py`` checks a subset in CI.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

KERNEL_MODULES = (
    "kernels.triton_attention",
    "kernels.triton_cache",
    "kernels.triton_norm",
    "kernels.triton_rope_cache",
    "kernels.triton_activation",
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


def _reload_kernels() -> None:
    for name in KERNEL_MODULES:
        if name in sys.modules:
            importlib.reload(sys.modules[name])
        else:
            importlib.import_module(name)


@contextlib.contextmanager
def compiled_kernel_modules() -> Iterator[None]:
    """The kernel modules with ``triton.jit`` compiling (``TRITON_INTERPRET`` unset while
    they are re-imported; the interpreter tests set it at import), restored afterwards."""
    saved = os.environ.pop("TRITON_INTERPRET", None)
    try:
        _reload_kernels()
        yield
    finally:
        if saved is not None:
            os.environ["TRITON_INTERPRET"] = saved
        _reload_kernels()


@contextlib.contextmanager
def recording() -> Iterator[list[Launch]]:
    """Every kernel launch in the block is recorded instead of run (outputs stay empty)."""
    launches: list[Launch] = []
    kernels = []
    for name in KERNEL_MODULES:
        module = sys.modules[name]
        for value in vars(module).values():
            if type(value).__name__ == "JITFunction" and value.__module__ == name:
                kernels.append(value)
    if not kernels:
        raise RuntimeError("no JITFunction kernels: the modules are interpreted")

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

    from workers.models import MODEL_REGISTRY

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
    would make them. Needs ``compiled_kernel_modules()`` and ``TANDEM_FORCE_TRITON=1``."""
    import torch

    from kernels import AttentionMetadata
    from workers.graphs.static_inputs import StaticDecodeInputs
    from workers.kv_cache import allocate_kv_cache

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


def main() -> int:
    """Compile the whole matrix; print one row per specialization; exit 1 on a failure."""
    import time

    import torch

    reason = aot_unavailable()
    if reason is not None:
        print(f"no Triton AOT compile here: {reason}")
        return 0
    import triton

    os.environ["TANDEM_FORCE_TRITON"] = "1"
    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    failures = 0
    print(f"triton {triton.__version__}, torch {torch.__version__}")
    print(f"{'target':<6} {'shape':<22} {'kernel':<24} {'smem B':>7}  signature dtypes; constexprs")
    with compiled_kernel_modules():
        launches = []
        for shape in SHAPES:
            for layout in ("blocks_first", "head_major"):
                launches += [
                    (shape, x) for x in record_model_launches(shape, dtypes, layout=layout)
                ]
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
            print(
                f"{target_name}: {len(seen)} specializations in {time.perf_counter() - start:.0f} s"
            )
    print(f"{failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
