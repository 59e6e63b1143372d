"""torch.compile a function once per process, for every caller, and what compiled steps need.

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


def allocate_static_cache(cache: Any, model: Any, rows: int) -> None:
    """Allocate a transformers StaticCache's tensors for `rows` sequences now, outside any
    compiled region: CUDA graphs need them at fixed addresses, which transformers marks only
    for a cache allocated in eager mode."""
    config = model.config
    cache.early_initialization(
        batch_size=rows, num_heads=config.num_key_value_heads,
        head_dim=getattr(config, "head_dim", None)
        or config.hidden_size // config.num_attention_heads,
        dtype=model.dtype, device=model.device)
