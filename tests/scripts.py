"""The benchmark scripts that tests call (folders without __init__.py), loaded by path."""

from __future__ import annotations

import importlib.util
from types import ModuleType

from tests.conftest import REPO


def benchmark_script(relative: str) -> ModuleType:
    """benchmarks/`relative` (e.g. "gpu_speculative/summary.py"), loaded as a module."""
    path = REPO / "benchmarks" / relative
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
