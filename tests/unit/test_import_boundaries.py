"""What the gateway imports from ``workers`` pulls in no engine code: the
``workers.text`` package (tokenizer, detokenizer), checked in a fresh
interpreter (this one has everything loaded)."""

import json
import subprocess
import sys


def loaded_after(imports: str) -> list[str]:
    """Our modules (``tandem.`` dropped) and torch / numpy loaded by ``import <imports>``."""
    code = (
        f"import json, sys, {imports}; "
        "print(json.dumps(sorted(m.removeprefix('tandem.') for m in sys.modules "
        "if m.startswith('tandem.') or m.split('.')[0] in ('torch', 'numpy'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def test_text_package_imports_nothing():
    assert loaded_after("tandem.workers.text") == ["workers", "workers.text"]


def test_tokenizer_and_detokenizer_import_no_engine_code():
    """Only themselves of ours. (transformers itself imports torch where it
    is installed; no module of ours adds to that.)"""
    loaded = loaded_after("tandem.workers.text.tokenizer, tandem.workers.text.detokenizer")
    ours = [m for m in loaded if m.split(".")[0] not in ("torch", "numpy")]
    assert ours == [
        "workers",
        "workers.text",
        "workers.text.detokenizer",
        "workers.text.tokenizer",
    ]


def test_engine_package_inits_import_nothing():
    """Package ``__init__`` files stay empty of imports, so importing one
    module of a package loads only what that module needs."""
    packages = ", ".join(
        f"tandem.workers.{p}" for p in ("engine", "runner", "sampling", "checkpoints", "text")
    )
    assert loaded_after(packages) == sorted(
        ["workers"]
        + [f"workers.{p}" for p in ("engine", "runner", "sampling", "checkpoints", "text")]
    )


def test_serve_configuration_builds_without_the_web_and_ray_stack():
    """The typed serve configuration (flags -> per-pool engine configs) imports none of
    the gateway's web stack, Ray or the metrics libraries: GPU images that carry only the
    engine's dependencies build engine configs through it (tests/gpu/test_cuda_pd_half_gpu.py)."""
    code = (
        "import importlib.abc, sys\n"
        "BLOCK = {'starlette', 'fastapi', 'ray', 'uvicorn', 'httpx', 'aiohttp',\n"
        "         'prometheus_client', 'opentelemetry', 'yaml'}\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name.split('.')[0] in BLOCK:\n"
        "            raise ModuleNotFoundError(f'blocked {name}')\n"
        "sys.meta_path.insert(0, Block())\n"
        "from tandem.cluster.cli.main import build_parser\n"
        "from tandem.cluster.cli.settings import pool_specs, resolve_config\n"
        "argv = ['serve', '--model', 'tiny', '--prefill', '1', '--decode', '1',\n"
        "        '--num-gpus-per-engine', '0.5', '--device', 'cuda']\n"
        "specs = pool_specs(resolve_config(build_parser().parse_args(argv)))\n"
        "print(sorted((s.role, s.num_gpus) for s in specs))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "[('decode', 0.5), ('prefill', 0.5)]"
