"""Check drafter tensors and configs against a layout description, listing every problem."""

from __future__ import annotations

import torch

from draftsmith.export.formats import TensorSpec

_DTYPES = {"int64": torch.int64, "bool": torch.bool}


def tensor_problems(tensors: dict[str, torch.Tensor], expected: dict[str, TensorSpec],
                    optional: dict[str, TensorSpec] | None = None) -> list[str]:
    """Missing and unknown keys, shapes, dtypes, and d2t/t2d consistency."""
    optional = optional or {}
    problems = []
    missing = sorted(set(expected) - set(tensors))
    unknown = sorted(set(tensors) - set(expected) - set(optional))
    if missing:
        problems.append(f"missing keys (SGLang/vLLM would leave them random): {missing}")
    if unknown:
        problems.append(f"unknown keys (SGLang would silently drop them): {unknown}")
    float_dtype = next((tensors[n].dtype for n, s in expected.items()
                        if s.dtype == "float" and n in tensors), None)
    for name, spec in {**expected, **optional}.items():
        if name not in tensors:
            continue
        tensor = tensors[name]
        if tuple(tensor.shape) != spec.shape:
            problems.append(f"{name}: shape {tuple(tensor.shape)}, expected {spec.shape}")
        want = _DTYPES.get(spec.dtype, float_dtype)
        if tensor.dtype != want:
            problems.append(f"{name}: dtype {tensor.dtype}, expected {want}")
    if not problems and "d2t" in expected:
        problems += vocab_map_problems(tensors["d2t"], tensors["t2d"])
    return problems


def vocab_map_problems(d2t: torch.Tensor, t2d: torch.Tensor) -> list[str]:
    target_ids = d2t + torch.arange(d2t.numel())  # [D]
    if (target_ids.min() < 0 or target_ids.max() >= t2d.numel()
            or not bool(t2d[target_ids].all()) or int(t2d.sum()) != d2t.numel()):
        return ["d2t and t2d disagree: d2t must hold offsets (target = draft + d2t) to exactly "
                "the ids t2d marks"]
    return []
