"""torch.compile a function once per process, for every caller, and what compiled steps need.

Compiling is slow (seconds to minutes), so each compiled function is made on first use and
kept: a second torch.compile of the same function would trace and compile it again. Its
kernels survive the process through inductor's cache (`train.compile_cache`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_map_only

log = logging.getLogger(__name__)

_COMPILED: dict[tuple, Callable] = {}


def compiled_once(fn: Callable, **options: Any) -> Callable:
    """torch.compile(fn, **options), made once for each (fn, options)."""
    key = (fn, tuple(sorted(options.items())))
    if key not in _COMPILED:
        _COMPILED[key] = torch.compile(fn, **options)
    return _COMPILED[key]


def cuda_graphs(device: torch.device) -> bool:
    """Whether fixed-shape steps on `device` are compiled into CUDA graphs (torch.compile's
    mode "reduce-overhead")."""
    return device.type == "cuda"


class GraphedStep:
    """A step compiled into CUDA graphs, safe to chain. A replay writes its outputs into the
    memory of the outputs that came before it (cudagraph trees free a generation's outputs
    when the next begins), so a drafter step's hidden state, fed to the next step, would be
    read after it was overwritten: torch raises "accessing tensor output of CUDAGraphs that
    has been overwritten by a subsequent run" (the first CUDA run, 2026-12-05). Each call
    therefore begins a generation of its own and returns copies of its tensors: a step's
    logits and hidden states, one copy kernel each (12.6 MB at most, a batch of 16 verifying
    4 tokens over a 49,152-token vocab); a cache passed in and out is not a tensor and stays
    as it is."""

    def __init__(self, compiled: Callable):
        self.compiled = compiled

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        torch.compiler.cudagraph_mark_step_begin()
        return tree_map_only(torch.Tensor, torch.clone, self.compiled(*args, **kwargs))


class EagerOnFailure:
    """A compiled step that, should it fail before it has once succeeded (a compiler or CUDA
    graph that this machine's torch cannot build), runs its eager function from then on and
    says so: the outputs stay the eager path's, only slower. Once it has succeeded, an error
    is the caller's; out of memory is never a compiler's."""

    def __init__(self, compiled: Callable, eager: Callable, name: str):
        self.compiled, self.eager, self.name = compiled, eager, name
        self.proven = self.failed = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.failed:
            return self.eager(*args, **kwargs)
        if self.proven:
            return self.compiled(*args, **kwargs)
        try:
            out = self.compiled(*args, **kwargs)
        except torch.OutOfMemoryError:
            raise
        except Exception as err:  # noqa: BLE001 - any compiler error, reported in full
            self.failed = True
            # The traceback too: a bare AssertionError from torch's CUDA-graph trees (seen on
            # the first CUDA run, after a retry in the same process) says nothing by itself.
            log.warning("%s: the compiled step failed (%s: %s); running it eagerly from here on",
                        self.name, type(err).__name__,
                        str(err).splitlines()[0][:300] if str(err) else "", exc_info=True)
            return self.eager(*args, **kwargs)
        self.proven = True
        return out


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
