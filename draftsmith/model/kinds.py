"""The drafter kinds, each described once (DESIGN.md "Drafter kinds").

An entry says what a kind is: its config and model classes, the name its native checkpoint
carries, how many positions its metrics count per anchor, how the embedded engine drafts with
it, the method vLLM serves it with, and where its loss and its layouts live. The loss (train/)
and the layouts (export/formats.py, as data) sit in the layers that run them; the entry names
them, and they are imported where they run, as the stage table names its modules. One config
setting, `drafter.kind`, picks the entry; adding a kind is one entry here plus its modules.

    eagle3  EAGLE-3 (and EAGLE-3.1: its norm options). Test-time training over TTT steps;
            drafts a chain or a tree one step per forward.
    dflash  DFlash. Anchored blocks; drafts a whole block of masked positions in one forward.
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel
from torch import nn

from draftsmith.config import DrafterConfig, TrainConfig
from draftsmith.errors import ConfigValueError
from draftsmith.model.dflash import DFlashConfig, DFlashDrafter
from draftsmith.model.eagle3 import NORM_OPTIONS, Eagle3Config, Eagle3Drafter

DrafterShape = Eagle3Config | DFlashConfig
Drafter = Eagle3Drafter | DFlashDrafter


@dataclass(frozen=True)
class DrafterKind:
    name: str  # drafter.kind
    summary: str
    config: type[BaseModel]
    model: type[nn.Module]
    native_format: str  # draftsmith.json's "format"
    drafting: Literal["chain", "block"]  # chain: step by step (trees too); block: one forward
    vllm_method: str  # vLLM's speculative method
    sglang_algorithm: str  # SGLang's --speculative-algorithm
    loss: str  # "module:function" of its row loss (draftsmith/train/)

    def part(self, dotted: str):
        """The function a "module:function" field names, imported now."""
        module, _, name = dotted.partition(":")
        return getattr(importlib.import_module(module), name)

    def build_config(self, target_config: dict, aux_layer_ids: list[int], draft_vocab_size: int,
                     settings: DrafterConfig, target_dir: str | Path | None = None
                     ) -> DrafterShape:
        """The drafter's shape for this target and data from the `drafter` section."""
        if settings.intermediate_size is not None:
            target_config = {**target_config, "intermediate_size": settings.intermediate_size}
        if self.name == "eagle3":
            return Eagle3Config.from_target(target_config, aux_layer_ids, draft_vocab_size,
                                            **settings.model_dump(include=set(NORM_OPTIONS)))
        options = settings.dflash
        mask = options.mask_token_id
        if mask is None:
            mask = resolve_mask_token_id(target_dir, target_config["vocab_size"])
        if not 0 <= mask < target_config["vocab_size"]:
            raise ConfigValueError(f"drafter.dflash.mask_token_id={mask} is not a token id of "
                                   f"this target (vocab {target_config['vocab_size']})")
        return DFlashConfig.from_target(target_config, aux_layer_ids, draft_vocab_size,
                                        num_hidden_layers=options.num_layers,
                                        block_size=options.block_size, mask_token_id=mask,
                                        causal=options.causal)

    def positions(self, settings: DrafterConfig, train: TrainConfig) -> int:
        """Positions each anchor's metrics count: TTT steps, or the block's drafted ones."""
        return train.ttt_steps if self.name == "eagle3" else settings.dflash.block_size - 1

    def position_weights(self, settings: DrafterConfig, train: TrainConfig) -> list[float]:
        """Each position's loss weight: train.step_weights (or step_weight_decay**j) over TTT
        steps; exp(-(k-1)/gamma) over block positions k = 1..B-1."""
        import math

        if self.name == "eagle3":
            if train.step_weights is not None:
                return list(train.step_weights)
            return [train.step_weight_decay**j for j in range(train.ttt_steps)]
        gamma = settings.dflash.loss_decay_gamma
        return [math.exp(-j / gamma) for j in range(self.positions(settings, train))]


EAGLE3 = DrafterKind(
    name="eagle3", summary="EAGLE-3 (EAGLE-3.1 with its norms): a chain or tree, step by step",
    config=Eagle3Config, model=Eagle3Drafter, native_format="draftsmith-eagle3",
    drafting="chain", vllm_method="eagle3", sglang_algorithm="EAGLE3",
    loss="draftsmith.train.row_loss:row_loss_on_device")
DFLASH = DrafterKind(
    name="dflash", summary="DFlash: a block of masked positions in one forward",
    config=DFlashConfig, model=DFlashDrafter, native_format="draftsmith-dflash",
    drafting="block", vllm_method="dflash", sglang_algorithm="DFLASH",
    loss="draftsmith.train.block_loss:block_row_loss_on_device")
KINDS: dict[str, DrafterKind] = {kind.name: kind for kind in (EAGLE3, DFLASH)}


def kind_named(name: str) -> DrafterKind:
    if name not in KINDS:
        raise ConfigValueError(f"unknown drafter kind {name!r}; choose from {sorted(KINDS)}")
    return KINDS[name]


def kind_of(thing: Any) -> DrafterKind:
    """The kind of a drafter config or model."""
    for kind in KINDS.values():
        if isinstance(thing, kind.config | kind.model):
            return kind
    raise TypeError(f"{type(thing).__name__} is no drafter kind's config or model")


def kind_of_native_format(fmt: str | None) -> DrafterKind | None:
    return next((k for k in KINDS.values() if k.native_format == fmt), None)


def build_drafter(cfg: DrafterShape) -> Drafter:
    return kind_of(cfg).model(cfg)


def resolve_mask_token_id(target_dir: str | Path | None, vocab_size: int) -> int:
    """The token DFlash's masked positions carry, resolved as speculators 0.9.0 does: the
    tokenizer's mask token; else the first embedding row past the tokenizer's tokens (an
    unused row); else its pad, eos or unk token."""
    if target_dir is None:
        raise ConfigValueError("drafter.dflash.mask_token_id is not set and there is no target "
                               "tokenizer to resolve it from: set drafter.dflash.mask_token_id")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
    if tokenizer.mask_token_id is not None:
        return int(tokenizer.mask_token_id)
    if len(tokenizer) < vocab_size:
        return len(tokenizer)
    for name in ("pad_token_id", "eos_token_id", "unk_token_id"):
        token = getattr(tokenizer, name, None)
        if token is not None:
            return int(token)
    config = json.loads((Path(target_dir) / "config.json").read_text())
    raise ConfigValueError(f"{target_dir}: its tokenizer has no mask, pad, eos or unk token and "
                           f"no unused embedding row (vocab {config.get('vocab_size')}): set "
                           "drafter.dflash.mask_token_id")
