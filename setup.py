"""Packaging: the top-level folders install under one ``tandem`` namespace.

The repository keeps the folders the design fixes at its top (``cluster/``,
``scheduler/``, ``kvtransfer/``, ``workers/``, ``kernels/``, ``wire/``); installed,
they are ``tandem.cluster``, ``tandem.scheduler`` and so on, so Tandem never
claims a generic top-level name (``kernels`` is also Hugging Face's package).
``tandem`` itself is a namespace package (no ``__init__.py``). Everything else
(metadata, dependencies, scripts) is in pyproject.toml.
"""

from setuptools import find_packages, setup

FOLDERS = ("cluster", "scheduler", "kvtransfer", "workers", "kernels", "wire")

found = find_packages(include=[*FOLDERS, *(f"{f}.*" for f in FOLDERS)])
setup(
    packages=[f"tandem.{name}" for name in found],
    package_dir={f"tandem.{folder}": folder for folder in FOLDERS},
)
