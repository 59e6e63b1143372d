"""The drafter kinds' registry, and what every kind says about itself (docs/drafter-kinds.md).

A kind is a package under draftsmith/model/ (`eagle3`, `dflash`) whose `__init__` defines a
`DrafterKind` subclass and registers one instance of it: its config and module, its loss, its
tensors and export layouts, and the rules its settings follow. The rest of the engine asks the
kind object (`kind_named(settings.kind)`, `kind_of(drafter)`) and never compares kind names.
One config setting, `drafter.kind`, picks the entry.

Nothing here or in a kind package's `__init__` imports torch: the config validators ask the
kinds about settings. A kind's module, loss and layouts are imported when first asked for.
Kind packages are found by name (`KIND_PACKAGES`) when the registry is first read, so that the
registry, which the kinds import, never imports them.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from draftsmith.errors import ConfigValueError

if TYPE_CHECKING:
    from pydantic import BaseModel
    from torch import nn

# Every kind's package; each registers its kind when imported.
KIND_PACKAGES = ("draftsmith.model.eagle3", "draftsmith.model.dflash")


class DrafterKind(ABC):
    """One drafter kind. Class attributes say what it is; methods are where kinds differ.
    `settings` is the `drafter` config section (DrafterConfig), `train` the `train` one,
    `config` the whole PipelineConfig, `shape` the kind's own drafter config."""

    name: ClassVar[str]  # drafter.kind
    summary: ClassVar[str]
    native_format: ClassVar[str]  # draftsmith.json's "format"
    drafting: ClassVar[Literal["chain", "block"]]  # chain: step by step (trees too); block: one
    vllm_method: ClassVar[str]  # vLLM's speculative method
    # Whether its training can run the merged per-document attention kernels (cudnn, flash).
    merged_attention: ClassVar[bool] = False
    # Its own boolean `drafter.*` options (off for every other kind), and what they are called.
    options: ClassVar[tuple[str, ...]] = ()
    options_name: ClassVar[str] = ""

    # ------------------------------------------------------------------ parts, imported lazily

    @property
    @abstractmethod
    def config(self) -> type[BaseModel]:
        """The kind's drafter config class (its shape)."""

    @property
    @abstractmethod
    def model(self) -> type[nn.Module]:
        """The kind's drafter module class."""

    @abstractmethod
    def row_loss(self) -> Callable[..., Any]:
        """The loss of one packed row and its metric counts, as the trainer calls it."""

    @abstractmethod
    def layouts(self) -> dict[str, Any]:
        """Its export layouts by name (export.format)."""

    @abstractmethod
    def native_layout(self) -> Any:
        """The layout whose tensor names are draftsmith's own for this kind."""

    def tensors(self, shape: Any, optional: bool = False) -> dict[str, Any]:
        """Every tensor of a drafter with `shape`, in draftsmith's names."""
        return self.native_layout().tensors(shape, optional)

    # ------------------------------------------------------------------ building and training

    def build_config(self, target_config: dict, aux_layer_ids: list[int],
                     draft_vocab_size: int, settings: Any, target_dir: Any = None) -> Any:
        """The drafter's shape for this target and data from the `drafter` section."""
        if settings.intermediate_size is not None:
            target_config = {**target_config, "intermediate_size": settings.intermediate_size}
        return self.shape_for(target_config, aux_layer_ids, draft_vocab_size, settings,
                              target_dir)

    @abstractmethod
    def shape_for(self, target_config: dict, aux_layer_ids: list[int], draft_vocab_size: int,
                  settings: Any, target_dir: Any = None) -> Any:
        """build_config's shape, from the target's config as the settings amend it."""

    @abstractmethod
    def positions(self, settings: Any, train: Any) -> int:
        """Positions each anchor's metrics count."""

    @abstractmethod
    def position_weights(self, settings: Any, train: Any) -> list[float]:
        """Each position's loss weight."""

    def settings_for(self, settings: Any, shape: Any) -> Any:
        """The `drafter` settings a trained drafter with `shape` runs with."""
        return settings

    def loss_options(self, settings: Any, padded: bool) -> dict[str, Any]:
        """The row loss's kind-specific keyword arguments (`padded`: static row shapes)."""
        return {}

    # ------------------------------------------------------------------ settings rules

    def check_settings(self, settings: Any) -> None:
        """Raise ValueError for `drafter` settings this kind cannot take: another kind's own
        options, switched on."""
        for other in all_kinds().values():
            if other is self:
                continue
            on = [name for name in other.options if getattr(settings, name)]
            if on:
                raise ValueError(f"drafter.{', drafter.'.join(on)}: {other.options_name} "
                                 f"options, and drafter.kind is {self.name!r}; remove them or "
                                 f"set drafter.kind={other.name}")

    def check_pipeline(self, config: Any) -> None:
        """Raise ValueError for a pipeline no stage could run with this kind (none by
        default)."""
        return None

    def drafting_warnings(self, config: Any) -> list[str]:
        """Drafting settings that are valid but probably not what the user wants."""
        return []

    @abstractmethod
    def trained_for(self, config: Any) -> str:
        """How far the drafter drafts as trained, for the drafting check's line."""

    def drafting_problem(self, shape: Any, num_steps: int, topk: int) -> str | None:
        """Why the drafter with `shape` cannot draft num_steps tokens with eagle_topk, or None."""
        return None

    def describe(self, shape: Any) -> dict[str, Any]:
        """Its own fields for `draftsmith inspect`."""
        return {}


KINDS: dict[str, DrafterKind] = {}


def register(kind: DrafterKind) -> DrafterKind:
    """Add a kind to the registry (each kind package calls this once)."""
    if kind.name in KINDS and KINDS[kind.name] is not kind:
        raise ValueError(f"drafter kind {kind.name!r} is registered twice")
    KINDS[kind.name] = kind
    return kind


def all_kinds() -> dict[str, DrafterKind]:
    """Every kind by name, its package imported on first use."""
    for package in KIND_PACKAGES:
        importlib.import_module(package)
    return KINDS


def kind_named(name: str) -> DrafterKind:
    kinds = all_kinds()
    if name not in kinds:
        raise ConfigValueError(f"unknown drafter kind {name!r}; choose from {sorted(kinds)}")
    return kinds[name]


def kind_of(thing: Any) -> DrafterKind:
    """The kind of a drafter config or model."""
    for kind in all_kinds().values():
        if isinstance(thing, kind.config | kind.model):
            return kind
    raise TypeError(f"{type(thing).__name__} is no drafter kind's config or model")


def kind_of_native_format(fmt: str | None) -> DrafterKind | None:
    return next((k for k in all_kinds().values() if k.native_format == fmt), None)


def build_drafter(shape: Any) -> Any:
    return kind_of(shape).model(shape)
