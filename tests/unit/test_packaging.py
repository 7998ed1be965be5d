"""Project-level guarantees: import boundaries and the `kernels` name clash."""

import subprocess
import sys


def _run(code: str) -> str:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    ).stdout.strip()


def test_scheduler_does_not_import_torch():
    assert (
        _run("import sys, scheduler, scheduler.scheduler; print('torch' in sys.modules)") == "False"
    )


def test_kvtransfer_interface_does_not_import_torch():
    out = _run("import sys, kvtransfer.base, kvtransfer.params; print('torch' in sys.modules)")
    assert out == "False"


def test_transformers_ignores_our_kernels_package():
    # transformers probes for the unrelated PyPI package `kernels` (hub kernels);
    # our top-level `kernels` must not be mistaken for it, and both must work.
    code = (
        "import kernels, transformers, torch\n"
        "from transformers.utils.import_utils import is_kernels_available\n"
        "from kernels import paged_attention\n"
        "cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,"
        " num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)\n"
        "m = transformers.LlamaForCausalLM(cfg).eval()\n"
        "out = m(torch.tensor([[1, 2, 3]])).logits\n"
        "print(is_kernels_available(), tuple(out.shape), kernels.__file__.endswith('kernels/__init__.py'))"
    )
    assert _run(code) == "False (1, 3, 32) True"
