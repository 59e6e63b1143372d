"""Every drafter kind, loaded: the registry (`registry.py`) with each kind package imported,
and the types any kind's drafter and shape have. The place the engine's stages import the kinds
from; adding a kind is a package under draftsmith/model/ that registers itself, named in
registry.KIND_PACKAGES."""

from __future__ import annotations

from draftsmith.model.drafter import TargetTiedDrafter
from draftsmith.model.registry import (
    DrafterKind,
    all_kinds,
    build_drafter,
    kind_named,
    kind_of,
    kind_of_native_format,
)
from draftsmith.model.shape import TargetTiedShape

__all__ = ["KINDS", "Drafter", "DrafterKind", "DrafterShape", "build_drafter", "kind_named",
           "kind_of", "kind_of_native_format"]

DrafterShape = TargetTiedShape  # any kind's drafter config
Drafter = TargetTiedDrafter  # any kind's drafter module
KINDS: dict[str, DrafterKind] = all_kinds()
