"""torch.compile a function once per process, for every caller.

Compiling is slow (seconds to minutes), so each compiled function is made on first use and
kept: a second torch.compile of the same function would trace and compile it again. Its
kernels survive the process through inductor's cache (`train.compile_cache`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

_COMPILED: dict[tuple, Callable] = {}


def compiled_once(fn: Callable, **options: Any) -> Callable:
    """torch.compile(fn, **options), made once for each (fn, options)."""
    key = (fn, tuple(sorted(options.items())))
    if key not in _COMPILED:
        _COMPILED[key] = torch.compile(fn, **options)
    return _COMPILED[key]
