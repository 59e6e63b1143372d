"""torch.compile a function once per process, for every caller, and what compiled steps need.

Compiling is slow (seconds to minutes), so each compiled function is made on first use and
kept: a second torch.compile of the same function would trace and compile it again. Its
kernels survive the process through inductor's cache (`train.compile_cache`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map_only, tree_unflatten

log = logging.getLogger(__name__)

_COMPILED: dict[tuple, Callable] = {}

# The graphs a compiled function under CapturedStep may hold: one per set of input shapes it
# is captured at (batch sizes, widths, cache lengths, and one engine per point of a
# benchmark's sweep). Past dynamo's default of 8, a function runs eagerly from then on, with
# a warning in the log only.
GRAPHS_PER_COMPILED_STEP = 64


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


def fixed_address(*tensors: torch.Tensor) -> None:
    """Mark tensors that live at one address for good (a static KV cache's buffers): a
    CapturedStep given one reads and writes it in place instead of copying it into a buffer
    of its own."""
    for tensor in tensors:
        tensor._fixed_address = True


def is_fixed(x: Any) -> bool:
    """Whether x is a tensor marked with `fixed_address`."""
    return isinstance(x, torch.Tensor) and getattr(x, "_fixed_address", False)


@dataclass
class _Capture:
    graph: torch.cuda.CUDAGraph | None  # None: replayed by running the step (not on CUDA)
    buffers: list[Any]  # per argument leaf: its input buffer (a tensor), or the object itself
    outputs: Any  # the step's outputs, overwritten by each replay


class CapturedStep:
    """A step of fixed shapes replayed from a CUDA graph, as vLLM and SGLang run their model
    steps: after a warm-up, one torch.cuda.CUDAGraph per call signature (the argument tree,
    each tensor's shape and dtype, the identity of anything else, such as a cache object) is
    recorded over input buffers of its own. A call copies its tensors into those buffers and
    replays the graph: the host's part of a step is a few copies and one launch, where a
    torch.compile "reduce-overhead" step checks its guards and CUDA-graph trees each time.

    - Tensors marked with `fixed_address` (cache buffers) are used in place, never copied.
    - `state(args, kwargs)` names the tensors the step advances (a StaticCache's counters):
      they are put back after the warm-up runs, so capturing leaves the step's state as
      it found it (recording a graph runs nothing).
    - The outputs are the graph's own tensors: each call overwrites the last call's, so a
      caller keeps a copy of what it needs past the next call (torch.cat, .tolist(), a
      cache write all copy).
    - `graphs=False` (the CPU) replays by running `fn` over the same buffers and copying its
      outputs into the same tensors: the buffer and aliasing behaviour of the CUDA path,
      testable where there is no CUDA."""

    def __init__(self, fn: Callable, state: Callable[[tuple, dict], list[torch.Tensor]]
                 | None = None, graphs: bool = True, warmups: int = 2):
        self.fn, self.state, self.graphs, self.warmups = fn, state, graphs, warmups
        self._captures: dict[tuple, _Capture] = {}

    @staticmethod
    def _signature(leaves: list[Any], spec: Any) -> tuple:
        def leaf(x: Any) -> tuple:
            if isinstance(x, torch.Tensor):
                return tuple(x.shape), x.dtype, x.device, is_fixed(x) and id(x)
            if isinstance(x, (bool, int, float, str, type(None))):
                return "value", x
            return "object", id(x)  # a cache: the graph holds its tensors' addresses

        return (spec, *(leaf(x) for x in leaves))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        leaves, spec = tree_flatten((args, kwargs))
        key = self._signature(leaves, spec)
        capture = self._captures.get(key)
        if capture is None:
            capture = self._captures[key] = self._capture(leaves, spec, args, kwargs)
        for buffer, leaf in zip(capture.buffers, leaves, strict=True):
            if isinstance(leaf, torch.Tensor) and buffer is not leaf:
                buffer.copy_(leaf)
        if capture.graph is not None:
            capture.graph.replay()
        else:
            ran = tree_flatten(self._run(capture.buffers, spec))[0]
            for output, value in zip(tree_flatten(capture.outputs)[0], ran, strict=True):
                output.copy_(value)
        return capture.outputs

    def forget(self) -> None:
        """Let go of every graph, and of what they hold (a cache about to be replaced)."""
        self._captures.clear()

    def _run(self, buffers: list[Any], spec: Any) -> Any:
        args, kwargs = tree_unflatten(buffers, spec)
        # A compiled fn gets a graph of fixed shapes per capture (what torch.compile's
        # dynamic=False does). By default dynamo makes a function's graph symbolic in every
        # size that changed since its first call: the target's forward met a tree's verify
        # width after plain decoding's and a chain's, and ran it as one graph for any width,
        # whose kernels cost more (1.14 plain steps on an H100 where the chain's cost 1.02).
        with torch._dynamo.config.patch(recompile_limit=GRAPHS_PER_COMPILED_STEP,
                                        automatic_dynamic_shapes=False):
            return self.fn(*args, **kwargs)

    def _capture(self, leaves: list[Any], spec: Any, args: tuple, kwargs: dict) -> _Capture:
        buffers = [x.clone() if isinstance(x, torch.Tensor) and not is_fixed(x) else x
                   for x in leaves]
        saved = self._save(args, kwargs)
        try:
            if not self.graphs:  # the outputs' tensors, made once, overwritten by each call
                outputs = self._warm_up(buffers, spec, args, kwargs, saved)
                return _Capture(None, buffers, tree_map_only(torch.Tensor, torch.clone, outputs))
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # compile, pick kernels and workspaces off the graph
                self._warm_up(buffers, spec, args, kwargs, saved)
            torch.cuda.current_stream().wait_stream(side)
        finally:
            self._restore(args, kwargs, saved)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outputs = self._run(buffers, spec)  # recorded, not run: the state stays
        return _Capture(graph, buffers, outputs)

    def _warm_up(self, buffers: list[Any], spec: Any, args: tuple, kwargs: dict,
                 saved: list[torch.Tensor]) -> Any:
        """Run the step `warmups` times, each from the state it was called with: a step that
        advances a cache's counter would otherwise write its second warm-up past the first,
        and a step as wide as the cache out of its bounds (a prompt step, 2026-12-06)."""
        for _ in range(self.warmups):
            outputs = self._run(buffers, spec)
            self._restore(args, kwargs, saved)
        return outputs

    def _save(self, args: tuple, kwargs: dict) -> list[torch.Tensor]:
        return [t.clone() for t in self.state(args, kwargs)] if self.state else []

    def _restore(self, args: tuple, kwargs: dict, saved: list[torch.Tensor]) -> None:
        for tensor, value in zip(self.state(args, kwargs) if self.state else [], saved,
                                 strict=True):
            tensor.copy_(value)


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
