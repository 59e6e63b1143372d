"""DFlash, one drafter kind. Anchored blocks; drafts a whole block of masked positions in one
forward.

The package owns the kind: its config and module (`model.py`), its anchored-block row loss
(`loss.py`), its tensors and its speculators layout (`layouts.py`), and the rules below,
among them the one check of how far a block drafts (`block_drafting_problem`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from draftsmith.errors import ConfigValueError
from draftsmith.model.registry import DrafterKind, register


def block_drafting_problem(block_size: int, num_steps: int, topk: int) -> str | None:
    """Why a block of `block_size` cannot draft num_steps tokens with eagle_topk, or None: a
    block drafts its block_size - 1 masked positions at most, and no tree."""
    drafts = block_size - 1
    if topk == 1 and num_steps <= drafts:
        return None
    return (f"one block drafts at most block_size - 1 = {drafts} tokens (block_size "
            f"{block_size}) and no tree; set num_steps <= {drafts} (num_draft_tokens = "
            "num_steps + 1) and eagle_topk=1")


class DFlashKind(DrafterKind):
    name = "dflash"
    summary = "DFlash: a block of masked positions in one forward"
    native_format = "draftsmith-dflash"
    drafting = "block"
    vllm_method = "dflash"

    @property
    def config(self):
        from draftsmith.model.dflash.model import DFlashConfig

        return DFlashConfig

    @property
    def model(self):
        from draftsmith.model.dflash.model import DFlashDrafter

        return DFlashDrafter

    def row_loss(self):
        from draftsmith.model.dflash.loss import block_row_loss_on_device

        return block_row_loss_on_device

    def layouts(self) -> dict[str, Any]:
        from draftsmith.model.dflash.layouts import DFLASH_SPECULATORS

        return {DFLASH_SPECULATORS.name: DFLASH_SPECULATORS}

    def native_layout(self):
        """vLLM's names are draftsmith's own for DFlash."""
        from draftsmith.model.dflash.layouts import DFLASH_SPECULATORS

        return DFLASH_SPECULATORS

    def shape_for(self, target_config: dict, aux_layer_ids: list[int], draft_vocab_size: int,
                  settings: Any, target_dir: Any = None):
        options = settings.dflash
        mask = options.mask_token_id
        if mask is None:
            mask = resolve_mask_token_id(target_dir, target_config["vocab_size"])
        if not 0 <= mask < target_config["vocab_size"]:
            raise ConfigValueError(f"drafter.dflash.mask_token_id={mask} is not a token id of "
                                   f"this target (vocab {target_config['vocab_size']})")
        return self.config.from_target(target_config, aux_layer_ids, draft_vocab_size,
                                       num_hidden_layers=options.num_layers,
                                       block_size=options.block_size, mask_token_id=mask,
                                       causal=options.causal)

    def positions(self, settings: Any, train: Any) -> int:
        """The block's drafted positions."""
        return settings.dflash.block_size - 1

    def position_weights(self, settings: Any, train: Any) -> list[float]:
        """exp(-(k-1)/gamma) over block positions k = 1..B-1."""
        gamma = settings.dflash.loss_decay_gamma
        return [math.exp(-j / gamma) for j in range(self.positions(settings, train))]

    def settings_for(self, settings: Any, shape: Any) -> Any:
        """The checkpoint's block, whatever the settings say."""
        return settings.model_copy(update={"dflash": settings.dflash.model_copy(
            update={"block_size": shape.block_size})})

    def loss_options(self, settings: Any, padded: bool) -> dict[str, Any]:
        return {"max_anchors": settings.dflash.max_anchors, "pad_anchors": padded}

    def check_pipeline(self, config: Any) -> None:
        """A DFlash drafter is written for vLLM and drafts one block, no tree and no more
        tokens than its masks: what no stage could run is refused before any runs. (More
        drafting steps than trained need no warning: a block's drafts are all trained, and
        more are refused.)"""
        if config.export.format != "speculators":
            raise ValueError(
                f"drafter.kind=dflash with export.format={config.export.format!r}: draftsmith "
                "writes DFlash drafters in the speculators layout vLLM 0.32 loads; set "
                "export.format=speculators (and deploy.engine=vllm or embedded)")
        if config.deploy.engine == "sglang":
            raise ValueError("drafter.kind=dflash with deploy.engine=sglang: draftsmith serves "
                             "DFlash drafters with vLLM or its embedded engine; set "
                             "deploy.engine=vllm or embedded")
        points = [("deploy", config.deploy.num_steps, config.deploy.eagle_topk),
                  *((f"benchmark.sweep[{i}]", p.num_steps, p.eagle_topk)
                    for i, p in enumerate(config.benchmark.sweep))]
        for where, steps, topk in points:
            problem = None if steps is None else \
                block_drafting_problem(config.drafter.dflash.block_size, steps, topk)
            if problem:
                raise ValueError(f"{where}.num_steps={steps}, eagle_topk={topk} with "
                                 f"drafter.kind=dflash: {problem}, or raise "
                                 "drafter.dflash.block_size")

    def trained_for(self, config: Any) -> str:
        return f"a DFlash block of {config.drafter.dflash.block_size}"

    def drafting_problem(self, shape: Any, num_steps: int, topk: int) -> str | None:
        return block_drafting_problem(shape.block_size, num_steps, topk)

    def describe(self, shape: Any) -> dict[str, Any]:
        return {"block_size": shape.block_size, "mask_token_id": shape.mask_token_id,
                "causal": shape.causal, "num_hidden_layers": shape.num_hidden_layers}


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


DFLASH = register(DFlashKind())
