"""Aux layer ids: draftsmith's canonical convention and what each serving engine reads.

Canonical (everywhere inside draftsmith): id c is the OUTPUT of decoder layer c, which is the
INPUT of layer c+1. Serving engines capture the input of some layer, and how they read the id
list in the drafter's config depends on the engine and, for SGLang, on the target's family
(docs/concepts.md, "Aux layer ids"; the rules are read from SGLang's and vLLM's source and pinned
by tests/test_sglang_conformance.py):

- SGLang, Llama / Qwen / most others: captures the input of id+1 -> write c.
- SGLang, DeepSeek family (DeepSeek V2/V3/V3.2, Kimi-K2/K2.5, GLM MoE DSA, GLM-4.7 lite): adds 1
  only when the first id is 1, otherwise uses the ids as inputs -> write c when c[0] == 1,
  c+1 when c[0] >= 2; c[0] == 0 cannot be expressed (refused).
- SGLang, GPT-OSS: ids used as inputs when max(ids) == num_layers, else +1 -> write c.
- vLLM (speculators layout): captures the input of layer id for every family -> write c+1.

Which canonical ids a run extracts (the configured list or EAGLE-3's default) is decided here
too, so the extract stage and the SGLang capture backend ask the same module.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from draftsmith.errors import ConfigValueError, InputError

if TYPE_CHECKING:
    from draftsmith.artifacts import Descriptor
    from draftsmith.config import ExtractConfig

FAMILIES = ("llama", "qwen", "deepseek", "gpt-oss")
ENGINES = ("sglang", "vllm")


class LayerIdError(InputError, ValueError):
    pass


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """EAGLE-3's default: outputs of layers 1, L//2-1 and L-4 (canonical convention)."""
    return [1, num_layers // 2 - 1, num_layers - 4]


def check_aux_layer_ids(ids: list[int], num_layers: int) -> list[int]:
    if not ids:
        raise ConfigValueError(
            f"extract.aux_layer_ids=[]: the drafter needs at least one aux layer; give ids "
            f"within 0..{num_layers - 1}, or remove the key for the default "
            f"{default_aux_layer_ids(num_layers)}")
    bad = [i for i in ids if not 0 <= i < num_layers]
    if bad:
        raise ConfigValueError(
            f"extract.aux_layer_ids={ids}: ids {bad} are outside 0..{num_layers - 1} "
            f"(id i = output of decoder layer i; this target has {num_layers} layers)"
        )
    if len(set(ids)) != len(ids) or sorted(ids) != ids:
        raise ConfigValueError(f"extract.aux_layer_ids={ids}: ids must be distinct and "
                               "ascending")
    return ids


def aux_layer_ids_for(cfg: ExtractConfig, target: Descriptor) -> list[int]:
    """The canonical aux ids a run extracts: extract.aux_layer_ids, or EAGLE-3's default."""
    from draftsmith.figures import TargetFigures

    num_layers = TargetFigures.of(target).num_layers
    ids = cfg.aux_layer_ids if cfg.aux_layer_ids is not None else default_aux_layer_ids(num_layers)
    return check_aux_layer_ids(list(ids), num_layers)


def _check_family(family: str) -> None:
    if family not in FAMILIES:
        raise LayerIdError(f"unknown target family {family!r}; expected one of {FAMILIES}")


def engine_layer_ids(canonical: list[int], family: str, engine: str) -> list[int]:
    """The ids to write into the drafter's config so `engine` captures the outputs of the
    `canonical` layers; refuses when no id list can do it."""
    _check_family(family)
    if engine == "vllm":
        return [c + 1 for c in canonical]
    if engine != "sglang":
        raise LayerIdError(f"unknown engine {engine!r}; expected one of {ENGINES}")
    if family != "deepseek" or canonical[0] == 1:
        return list(canonical)
    if canonical[0] == 0:
        raise LayerIdError(
            f"aux layers {canonical} (outputs) cannot be expressed for SGLang on a "
            "DeepSeek-family target: it captures the input of layer id+1 only when the first "
            "id is 1, so the output of layer 0 is unreachable together with the others. "
            "Extract with a first aux layer >= 1 and retrain."
        )
    return [c + 1 for c in canonical]


def canonical_layer_ids(written: list[int], family: str, engine: str,
                        num_layers: int | None = None) -> list[int]:
    """Inverse of engine_layer_ids: the outputs an engine feeds a drafter whose config says
    `written`. num_layers matters only for SGLang's GPT-OSS rule."""
    _check_family(family)
    if engine == "vllm":
        return [w - 1 for w in written]
    if engine != "sglang":
        raise LayerIdError(f"unknown engine {engine!r}; expected one of {ENGINES}")
    if family == "deepseek" and written[0] != 1:
        return [w - 1 for w in written]
    if family == "gpt-oss" and num_layers is not None and max(written) == num_layers:
        return [w - 1 for w in written]
    return list(written)
