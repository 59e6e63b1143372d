"""Drafter checkpoint layouts, by drafter kind: what the converter, the validator and the export
stage look up. Each kind describes its tensors and layouts once, in its own package
(`draftsmith/model/eagle3/layouts.py`, `draftsmith/model/dflash/layouts.py`), on the shared
base of `draftsmith/export/layout.py`; this module gathers them from the kind registry.
"""

from __future__ import annotations

from draftsmith.export.layout import (
    NATIVE_LAYER_PREFIX,
    OPTIONAL_TENSORS,
    VOCAB_MAP,
    ExportError,
    Layout,
    TensorSpec,
)
from draftsmith.model.dflash.layouts import DFLASH_SPECULATORS, dflash_tensors
from draftsmith.model.eagle3.layouts import SGLANG, SPECULATORS, drafter_tensors
from draftsmith.model.kinds import KINDS, DrafterShape, kind_of

__all__ = ["DFLASH_SPECULATORS", "NATIVE_LAYER_PREFIX", "OPTIONAL_TENSORS", "SGLANG",
           "SPECULATORS", "VOCAB_MAP", "ExportError", "Layout", "TensorSpec", "all_layouts",
           "dflash_tensors", "drafter_tensors", "layout_named", "tensors_of"]


def tensors_of(cfg: DrafterShape, optional: bool = False) -> dict[str, TensorSpec]:
    """The tensors of a drafter of any kind, in draftsmith's names."""
    return kind_of(cfg).tensors(cfg, optional)


# Every layout, by drafter kind and then by name (export.format).
LAYOUTS_BY_KIND: dict[str, dict[str, Layout]] = {name: kind.layouts()
                                                 for name, kind in KINDS.items()}


def layout_named(name: str, kind: str) -> Layout:
    layouts = LAYOUTS_BY_KIND.get(kind, {})
    if name not in layouts:
        raise ExportError(f"unknown layout {name!r} for a {kind} drafter; choose from "
                          f"{sorted(layouts)}")
    return layouts[name]


def all_layouts() -> list[Layout]:
    return [layout for layouts in LAYOUTS_BY_KIND.values() for layout in layouts.values()]
