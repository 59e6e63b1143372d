"""EAGLE-3 (and EAGLE-3.1: its norm options), one drafter kind. Test-time training over TTT
steps; drafts a chain or a tree one step per forward.

The package owns the kind: its config and module (`model.py`), its TTT row loss (`loss.py`),
its tensors and its SGLang and speculators layouts (`layouts.py`), and the rules below.
"""

from __future__ import annotations

from typing import Any

from draftsmith.errors import ConfigValueError
from draftsmith.model.eagle3.options import NORM_OPTIONS
from draftsmith.model.registry import DrafterKind, register


class Eagle3Kind(DrafterKind):
    name = "eagle3"
    summary = "EAGLE-3 (EAGLE-3.1 with its norms): a chain or tree, step by step"
    native_format = "draftsmith-eagle3"
    drafting = "chain"
    vllm_method = "eagle3"
    merged_attention = True
    options = NORM_OPTIONS
    options_name = "EAGLE-3.1"

    @property
    def config(self):
        from draftsmith.model.eagle3.model import Eagle3Config

        return Eagle3Config

    @property
    def model(self):
        from draftsmith.model.eagle3.model import Eagle3Drafter

        return Eagle3Drafter

    def row_loss(self):
        from draftsmith.model.eagle3.loss import row_loss_on_device

        return row_loss_on_device

    def layouts(self) -> dict[str, Any]:
        from draftsmith.model.eagle3.layouts import SGLANG, SPECULATORS

        return {layout.name: layout for layout in (SGLANG, SPECULATORS)}

    def native_layout(self):
        """SGLang's names are draftsmith's own for EAGLE-3."""
        from draftsmith.model.eagle3.layouts import SGLANG

        return SGLANG

    def shape_for(self, target_config: dict, aux_layer_ids: list[int], draft_vocab_size: int,
                  settings: Any, target_dir: Any = None):
        return self.config.from_target(target_config, aux_layer_ids, draft_vocab_size,
                                       **settings.model_dump(include=set(NORM_OPTIONS)))

    def positions(self, settings: Any, train: Any) -> int:
        """One per TTT step."""
        return train.ttt_steps

    def position_weights(self, settings: Any, train: Any) -> list[float]:
        """train.step_weights, or step_weight_decay**j over the TTT steps."""
        if train.step_weights is None:
            return [train.step_weight_decay**j for j in range(train.ttt_steps)]
        if len(train.step_weights) != train.ttt_steps:
            raise ConfigValueError(f"train.step_weights has {len(train.step_weights)} entries, "
                                   f"ttt_steps is {train.ttt_steps}: give one weight per step")
        return list(train.step_weights)

    def drafting_warnings(self, config: Any) -> list[str]:
        """Drafting more steps than were trained: the later ones are rarely accepted."""
        out = []
        trained = config.train.ttt_steps
        drafting = [("deploy.num_steps", config.deploy.num_steps),
                    ("export.speculative_tokens", config.export.speculative_tokens),
                    *((f"benchmark.sweep[{i}].num_steps", p.num_steps)
                      for i, p in enumerate(config.benchmark.sweep))]
        for where, steps in drafting:
            if steps is not None and steps > trained:
                out.append(f"{where}={steps} exceeds train.ttt_steps={trained}: the drafter "
                           f"was trained for {trained} drafting steps, and the later ones are "
                           "rarely accepted; raise train.ttt_steps or draft fewer steps")
        return out

    def trained_for(self, config: Any) -> str:
        return f"train.ttt_steps={config.train.ttt_steps}"

    def describe(self, shape: Any) -> dict[str, Any]:
        return {"norms": shape.norm_flags, "sliding_window": shape.sliding_window}


EAGLE3 = register(Eagle3Kind())
