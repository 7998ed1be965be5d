"""The gateway process bars torch (``cluster/gateway/torch_free.py``): with torch barred, the
serve command's modules import, the app builds over a backend, the model's tokenizer loads and
encodes a chat, and a model directory is resolved with the in-process call's answers and
errors: in a child interpreter where that needs torch (``workers/checkpoints/model_dir.py``),
in the process itself for the built tiny checkpoint and an existing directory. Each case
runs in a fresh interpreter (this test process has torch loaded)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tandem.workers.checkpoints.tiny import ensure_tiny_model

pytestmark = pytest.mark.long  # tens of seconds: started early (tests/conftest.py)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_barred(code: str, timeout_s: float = 180.0) -> dict:
    """Run ``code`` after ``bar_torch()`` in a fresh interpreter; it prints one JSON line."""
    prologue = "import json, sys\nfrom tandem.cluster.gateway.torch_free import bar_torch\nassert bar_torch()\n"
    done = subprocess.run(
        [sys.executable, "-c", prologue + code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_gateway_builds_and_tokenizes_with_torch_barred():
    tiny = ensure_tiny_model()
    out = run_barred(
        "import tandem.cluster.cli.serve, tandem.cluster.disagg.ray_backend, tandem.cluster.engines.pools\n"
        "from tandem.cluster.gateway.app import create_app\n"
        "from tandem.cluster.gateway.null_backend import NullBackend\n"
        "from tandem.workers.text.detokenizer import IncrementalDetokenizer\n"
        "from tandem.workers.text.tokenizer import apply_chat_template, load_tokenizer\n"
        f"tok = load_tokenizer({tiny!r})\n"
        "app = create_app(NullBackend(tok))\n"
        "ids = apply_chat_template(tok, [{'role': 'user', 'content': 'hi'}])\n"
        "print(json.dumps({'ids': ids, 'torch': sys.modules['torch'],\n"
        "                  'loaded': sorted(m for m in sys.modules if m.startswith('torch.'))}))\n"
    )
    from tandem.workers.text.tokenizer import apply_chat_template, load_tokenizer

    assert out["torch"] is None and out["loaded"] == []
    # the same ids as with torch loaded (this process)
    assert out["ids"] == apply_chat_template(
        load_tokenizer(tiny), [{"role": "user", "content": "hi"}]
    )


def test_a_model_that_needs_torch_resolves_in_a_child_when_torch_is_barred():
    """A built-in GGUF name goes through the converter (torch): the child answers with the
    converted directory, as the call in this process does."""
    from tandem.workers.checkpoints.loader import resolve_model_path

    converted = resolve_model_path("smollm2")  # converted here first if it is not yet
    out = run_barred(
        "import subprocess\n"
        "from tandem.workers.checkpoints.model_dir import resolve_model_dir\n"
        "children = []\n"
        "run = subprocess.run\n"
        "subprocess.run = lambda argv, **kw: children.append(argv[-1]) or run(argv, **kw)\n"
        "print(json.dumps({'path': resolve_model_dir('smollm2'), 'torch': sys.modules['torch'],\n"
        "                  'children': children}))\n"
    )
    assert out == {"path": converted, "torch": None, "children": ["smollm2"]}


def test_a_built_tiny_and_a_model_directory_resolve_without_a_child(tmp_path):
    """What needs no torch (``model_dir.ready_model_dir``) is answered in the gateway's own
    process: the built tiny checkpoint and a directory with a config.json, as
    ``resolve_model_path`` answers them; the child interpreter (2-3 s of CPU) is not started."""
    from tandem.workers.checkpoints.loader import resolve_model_path

    tiny = ensure_tiny_model()
    (tmp_path / "config.json").write_text("{}")
    relative = os.path.relpath(tmp_path, ROOT)
    out = run_barred(
        "import subprocess\n"
        "from tandem.workers.checkpoints.model_dir import resolve_model_dir\n"
        "subprocess.run = None  # no child\n"
        f"paths = [resolve_model_dir(m) for m in ('tiny', {str(tmp_path)!r}, {relative!r})]\n"
        "print(json.dumps({'paths': paths, 'torch': sys.modules['torch']}))\n"
    )
    assert out == {"paths": [tiny, str(tmp_path), str(tmp_path)], "torch": None}
    assert resolve_model_path(str(tmp_path)) == str(tmp_path)


@pytest.mark.parametrize(
    ("model", "error", "match"),
    [
        ("/no/such/dir", "FileNotFoundError", "does not exist"),
        ("missing.gguf", "FileNotFoundError", "no such GGUF file"),
    ],
)
def test_resolution_errors_keep_their_class_and_message(model, error, match):
    from tandem.workers.checkpoints.loader import resolve_model_path

    with pytest.raises(FileNotFoundError) as in_process:
        resolve_model_path(model)
    out = run_barred(
        "from tandem.workers.checkpoints.model_dir import resolve_model_dir\n"
        "try:\n"
        f"    resolve_model_dir({model!r})\n"
        "except Exception as exc:\n"
        "    print(json.dumps({'type': type(exc).__name__, 'message': str(exc)}))\n"
    )
    assert out == {"type": error, "message": str(in_process.value)}
    assert match in out["message"]


def test_bar_torch_declines_once_torch_is_loaded():
    from tandem.cluster.gateway.torch_free import bar_torch

    assert "torch" in sys.modules and sys.modules["torch"] is not None
    assert bar_torch() is False
    assert sys.modules["torch"] is not None  # this process keeps its torch


def test_structured_output_validation_is_torch_free():
    """The gateway validates specs and tools with llguidance, torch barred (issue #27)."""
    out = run_barred(
        "from tandem.cluster.gateway.edge import structured\n"
        "from tandem.cluster.gateway.protocol import ProtocolError\n"
        "from tandem.cluster.gateway.tools import formatting, request\n"
        "from tandem.wire.engine_protocol import StructuredOutputsParams as S\n"
        "structured.check(S('json', '{\"type\": \"object\"}'), 'x')\n"
        "try:\n"
        "    structured.check(S('regex', '[a-'), 'guided_regex')\n"
        "    bad = None\n"
        "except ProtocolError as exc:\n"
        "    bad = exc.param\n"
        "print(json.dumps({'bad': bad, 'torch': sys.modules['torch'],\n"
        "                  'llguidance': 'llguidance' in sys.modules}))\n"
    )
    assert out == {"bad": "guided_regex", "torch": None, "llguidance": True}


def test_the_null_backend_gateway_starts_torch_free_and_freezes_its_heap():
    """``benchmarks/serve_gateway.py``'s gateway process, set up as ``tandem serve``'s: the
    null backend finds ``tiny`` (built: without a child), and after ``freeze_startup_heap`` the collector
    walks only what was allocated since and its young generation waits for ``YOUNG_THRESHOLD``
    net allocations (``cluster/gateway/heap.py``); the collector still runs; the app still streams."""
    out = run_barred(
        "import asyncio, gc\n"
        "from tandem.cluster.gateway.app import create_app\n"
        "from tandem.cluster.gateway.heap import YOUNG_THRESHOLD, freeze_startup_heap\n"
        "from tandem.cluster.gateway.null_backend import NullBackend\n"
        "from tandem.wire.engine_protocol import EngineRequest, SamplingParams\n"
        "backend = NullBackend.tiny()\n"
        "app = create_app(backend)\n"
        "frozen = freeze_startup_heap()\n"
        "tracked = len(gc.get_objects())\n"
        "async def main():\n"
        "    request = EngineRequest('r', [5, 6], SamplingParams(max_tokens=3, ignore_eos=True))\n"
        "    return [o.new_token_ids async for o in backend.generate(request)]\n"
        "outs = asyncio.run(main())\n"
        "print(json.dumps({'frozen': frozen, 'tracked': tracked, 'outs': outs,\n"
        "                  'torch': sys.modules['torch'], 'threshold': gc.get_threshold(),\n"
        "                  'young': YOUNG_THRESHOLD, 'enabled': gc.isenabled()}))\n"
    )
    assert out["torch"] is None
    assert out["frozen"] > 10 * out["tracked"]  # the startup heap is out of the collector's walk
    assert len(out["outs"]) == 3
    # the collector still runs; its older generations keep CPython's thresholds
    assert out["enabled"] and out["threshold"] == [out["young"], 10, 10]
