"""The parts of a drafter checkpoint layout every kind shares: the tensor description, the
layout base (how draftsmith's tensor names appear in a layout's files, which config fields it
requires, how its config.json maps to and from the kind's config) and the export error. Each
kind describes its tensors and its layouts in its own package (draftsmith/model/<kind>/
layouts.py); the converter and the validator both read those descriptions, so the two cannot
drift apart.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from draftsmith.errors import InputError
from draftsmith.export.layer_ids import canonical_layer_ids, engine_layer_ids

NATIVE_LAYER_PREFIX = "midlayer."
# Present in some checkpoints (SpecForge, speculators); never required, never exported: the
# serving engine shares the target's embedding.
OPTIONAL_TENSORS = ("embed_tokens.weight",)
VOCAB_MAP = ("d2t", "t2d")


class ExportError(InputError, ValueError):
    pass


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: str  # "float" (the checkpoint's weight dtype), "int64" or "bool"


@dataclass(frozen=True)
class Layout:
    """One on-disk drafter layout: names, architecture, required config fields."""

    name: str
    engine: str  # whose layer-id rule applies: "sglang" or "vllm"
    architecture: str
    layer_prefix: str
    required_config: tuple[str, ...]
    kind: str  # the name of the drafter kind it holds (draftsmith/model/registry.py)
    native_prefix: str = NATIVE_LAYER_PREFIX  # the layer names' prefix in draftsmith's names
    # vLLM creates no draft_id_to_target_id when draft_vocab_size == vocab_size, and a d2t
    # tensor then fails to load: such a layout leaves the (identity) vocab map out.
    identity_vocab_map_omitted: bool = False
    # Other names the same layout is saved under (read, never written).
    also_read_as: tuple[str, ...] = ()
    # Older tensor names the engine still loads (read as the new ones, never written).
    legacy_names: tuple[tuple[str, str], ...] = ()

    def architectures(self) -> tuple[str, ...]:
        return (self.architecture, *self.also_read_as)

    def tensors(self, cfg, optional: bool = False) -> dict[str, TensorSpec]:
        """Every tensor of a drafter of this layout's kind with `cfg`, in draftsmith's names
        (`optional`: with the tensors a checkpoint may also hold)."""
        raise NotImplementedError

    def native_tensors(self, cfg, optional: bool = False) -> dict[str, TensorSpec]:
        """tensors(cfg), less what this layout leaves out."""
        specs = self.tensors(cfg, optional)
        if self.identity_vocab_map_omitted and cfg.draft_vocab_size == cfg.vocab_size:
            specs = {n: spec for n, spec in specs.items() if n not in VOCAB_MAP}
        return specs

    def to_layout_name(self, native: str) -> str:
        if native.startswith(self.native_prefix):
            return self.layer_prefix + native.removeprefix(self.native_prefix)
        return native

    def to_native_name(self, name: str) -> str:
        if name.startswith(self.layer_prefix):
            return self.native_prefix + name.removeprefix(self.layer_prefix)
        return name

    def read_names(self, names: Iterable[str]) -> dict[str, str]:
        """Each file name as this layout's current name (older names the engine still loads
        renamed; anything else as it is, for the validator to judge)."""
        renamed = {}
        for name in names:
            renamed[name] = name
            for legacy, current in self.legacy_names:
                if name.startswith(legacy):
                    renamed[name] = current + name.removeprefix(legacy)
        return renamed

    def expected_tensors(self, cfg, optional: bool = False) -> dict[str, TensorSpec]:
        return {self.to_layout_name(n): s for n, s in self.native_tensors(cfg, optional).items()}

    def is_layout_of(self, config: dict[str, Any]) -> bool:
        return any(a in (config.get("architectures") or []) for a in self.architectures())

    def build_config(self, cfg, family: str, dtype: str,
                     extras: dict[str, Any]) -> dict[str, Any]:
        raise NotImplementedError

    def parse_config(self, config: dict[str, Any], family: str,
                     num_layers: int | None = None):
        raise NotImplementedError

    def check(self, cfg) -> None:
        """What this layout cannot hold raises ExportError before anything is written."""

    def written_layer_ids(self, config: dict[str, Any]) -> list[int]:
        raise NotImplementedError

    def canonical_ids(self, config: dict[str, Any], family: str,
                      num_layers: int | None) -> list[int]:
        """draftsmith's own exports say their canonical ids; others follow the engine rule."""
        ours = config.get("draftsmith") or {}
        written = self.written_layer_ids(config)
        canonical = ours.get("canonical_aux_layer_ids")
        if not canonical:
            return canonical_layer_ids(written, family, self.engine, num_layers)
        # The engine reads the written ids, not ours: an edited file must not pass unnoticed.
        expected = engine_layer_ids(canonical, ours.get("target_family") or family, self.engine)
        if written != expected:
            raise ExportError(
                f"the aux layer ids the engine reads ({written}) disagree with "
                f"draftsmith.canonical_aux_layer_ids {canonical}, which a "
                f"{ours.get('target_family') or family} target needs written as {expected}; "
                "the config was edited or damaged: export it again with `draftsmith export`")
        return canonical

    def missing_config(self, config: dict[str, Any]) -> list[str]:
        return [f for f in self.required_config if _lookup(config, f) is None]


def _lookup(config: dict[str, Any], dotted: str) -> Any:
    node: Any = config
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def speculators_verifier(extras: dict[str, Any]) -> dict[str, Any]:
    verifier = extras.get("verifier") or {}
    return {"name_or_path": verifier.get("name_or_path", ""),
            "architectures": verifier.get("architectures", [])}
