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
