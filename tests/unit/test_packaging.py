"""Project-level guarantees: import boundaries and the `kernels` name clash."""

import ast
import importlib
import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path

import tomllib

from benchmarks.checkout import FOLDERS


def _run(code: str) -> str:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    ).stdout.strip()


def test_scheduler_does_not_import_torch():
    assert _run("import sys, tandem.scheduler.scheduler; print('torch' in sys.modules)") == "False"


def test_kvtransfer_interface_does_not_import_torch():
    out = _run(
        "import sys, tandem.kvtransfer.base, tandem.kvtransfer.params; print('torch' in sys.modules)"
    )
    assert out == "False"


def test_transformers_ignores_our_kernels_package():
    # transformers probes for the unrelated PyPI package `kernels` (hub kernels);
    # ours is `tandem.kernels`, so no top-level `kernels` of ours exists to be
    # mistaken for it, and both work.
    code = (
        "import importlib.util, transformers, torch\n"
        "import tandem.kernels as kernels\n"
        "from transformers.utils.import_utils import is_kernels_available\n"
        "from tandem.kernels import paged_attention\n"
        "assert importlib.util.find_spec('kernels') is None or 'tandem' not in "
        "importlib.util.find_spec('kernels').origin\n"
        "cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,"
        " num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)\n"
        "m = transformers.LlamaForCausalLM(cfg).eval()\n"
        "out = m(torch.tensor([[1, 2, 3]])).logits\n"
        "print(is_kernels_available(), tuple(out.shape), kernels.__file__.endswith('kernels/__init__.py'))"
    )
    assert _run(code) == "False (1, 3, 32) True"


# ---- declared dependencies ---------------------------------------------------------

ROOT = Path(__file__).resolve().parents[2]
# the packages this project ships (pyproject's setuptools include list)
# the folders this project ships, each installed as ``tandem.<folder>`` (setup.py)
RUNTIME_PACKAGES = set(FOLDERS)
OUR_PACKAGES = RUNTIME_PACKAGES | {"tandem", "benchmarks", "tests"}

# How each floor in pyproject.toml was verified. "pin": the version CI
# installs (requirements-cpu.txt), the only one the suite runs against.
# "overlay": that exact version (with --no-deps, in front of the CI venv:
# `pip install --no-deps --target D pkg==V; PYTHONPATH=D pytest ...`) passed
# the named tests on 2026-11-23. transformers 5.18.0 ran with its own floors
# (tokenizers 0.23.1, huggingface-hub 1.31.0, safetensors 0.8.0); 5.0.0-5.17.0
# pass the detokenizer/model tests but fail GGUF loading (their tokenizer
# conversion hands `tokenizers` merges it refuses: test_gguf_synthetic.py).
# Lowering a floor means running such a check and recording it here.
_TF = "overlay with transformers 5.18.0: tests/workers (gguf, models, tiny, loader, detokenizer)"
VERIFIED_FLOORS = {
    "msgspec": ("0.19", "overlay: tests/unit, tests/cluster/test_gateway.py + serve_config"),
    "xxhash": ("3.0", "overlay: tests/unit (block hashes)"),
    "pyzmq": ("27.3", "pin"),
    "numpy": ("1.26.4", "overlay: tests/kernels/test_reference.py, tests/workers/test_engine.py"),
    "torch": ("2.13", "pin"),
    "triton": ("3.9", "pin"),
    "transformers": ("5.18", _TF),
    "tokenizers": ("0.23.1", _TF),
    "huggingface-hub": ("1.31", _TF),
    "safetensors": ("0.8", "pin (transformers 5.18 needs it)"),
    "gguf": ("0.19", "pin"),
    "nixl": ("1.5.1", "pin"),
    "ray": ("2.60", "pin"),
    "fastapi": ("0.163.2", "pin"),
    "starlette": ("1.10", "pin"),
    "uvicorn": ("0.54", "pin"),
    "prometheus-client": ("0.20", "overlay: tests/cluster/test_gateway.py (metrics)"),
    "aiohttp": ("3.14.5", "pin"),
    "pyyaml": ("6.0", "overlay: tests/cluster/test_serve_config.py"),
    "opentelemetry-sdk": ("1.45", "pin"),
    "opentelemetry-exporter-otlp-proto-http": ("1.45", "pin"),
    "httpx": ("0.28.1", "pin"),
    "llguidance": ("1.9.1", "pin"),
}

# API the code uses that older releases lack: (distribution, module, name,
# first release that has it). Each floor must be at or above these.
API_FLOORS = [
    # workers/text/detokenizer.py: the Rust-backed tokenizer class of transformers 5
    # (transformers 4.x has tokenization_utils_fast.PreTrainedTokenizerFast instead)
    ("transformers", "transformers.tokenization_utils_tokenizers", "TokenizersBackend", "5.0"),
    # scheduler/block_hash.py: --prefix-caching-hash-algo xxhash128
    ("xxhash", "xxhash", "xxh3_128_digest", "2.0"),
]


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _declared() -> dict[str, dict[str, str]]:
    """{"runtime"|"test": {normalized name: floor}} from pyproject.toml."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    out: dict[str, dict[str, str]] = {}
    for group, specs in (
        ("runtime", project["dependencies"]),
        ("test", project["optional-dependencies"]["test"]),
    ):
        out[group] = {}
        for spec in specs:
            m = re.fullmatch(r"([A-Za-z0-9_.-]+)(\[[^\]]*\])?>=([0-9.]+)", spec)
            assert m, f"{spec!r}: every dependency is declared as name>=floor"
            out[group][_normalize(m.group(1))] = m.group(3)
    return out


def _vtuple(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.match(r"[0-9.]*[0-9]", version).group(0).split("."))


def _third_party_imports(package: str) -> set[str]:
    names = set()
    for path in (ROOT / package).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                mods = [node.module]
            else:
                continue
            for mod in mods:
                top = mod.split(".")[0]
                if top not in sys.stdlib_module_names and top not in OUR_PACKAGES:
                    names.add(top)
    return names


def _optional_extras() -> set[str]:
    """Packages of the optional extras other than ``test`` (e.g. ``fast``): the code imports
    them only where installed (``try: import uvloop``), so they need no runtime floor."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    return {
        _normalize(re.match(r"[A-Za-z0-9_.-]+", spec).group(0))
        for group, specs in extras.items()
        if group != "test"
        for spec in specs
    }


def test_every_third_party_import_is_declared():
    declared = _declared()
    optional = _optional_extras()
    dists = importlib.metadata.packages_distributions()
    for package in sorted(RUNTIME_PACKAGES | {"tests"}):
        allowed = set(declared["runtime"]) | optional
        allowed |= set(declared["test"]) if package == "tests" else set()
        for top in sorted(_third_party_imports(package)):
            names = {_normalize(d) for d in dists.get(top, [top])}
            assert names & set(allowed), (
                f"{package}/ imports {top} ({names}) but does not declare it"
            )


def test_floors_are_verified_and_installed():
    declared = _declared()
    pins = {}
    for line in (ROOT / "requirements-cpu.txt").read_text().splitlines():
        m = re.fullmatch(r"([A-Za-z0-9_.-]+)(\[[^\]]*\])?==(\S+)", line.strip())
        if m:
            pins[_normalize(m.group(1))] = m.group(3)
    assert set(declared["runtime"]) == set(VERIFIED_FLOORS)
    for name, floor in declared["runtime"].items():
        recorded, how = VERIFIED_FLOORS[name]
        assert floor == recorded, f"{name}>={floor} but the verified floor is {recorded} ({how})"
        if how.startswith("pin"):
            assert _vtuple(floor) == _vtuple(pins[name])[: len(_vtuple(floor))], (name, pins[name])
        assert _vtuple(importlib.metadata.version(name)) >= _vtuple(floor), name
    for name, floor in declared["test"].items():
        assert _vtuple(floor) == _vtuple(pins[name])[: len(_vtuple(floor))], (name, pins[name])


def test_floors_cover_the_api_the_code_uses():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    # asyncio.timeout (cluster/gateway/responses.py) and tomllib are Python 3.11's; the suite runs on 3.11
    assert project["requires-python"] == ">=3.11"
    declared = _declared()["runtime"]
    for dist, module, name, since in API_FLOORS:
        assert hasattr(importlib.import_module(module), name), f"{module}.{name} missing"
        assert _vtuple(declared[dist]) >= _vtuple(since), (
            f"{dist}>={declared[dist]} but the code uses {module}.{name} (since {since})"
        )
