"""Stage `fix-keys`: export the trained drafter to the serving engine's layout and validate it.

The exported config carries the aux layer ids the engine needs for this target's family, and a
max_position_embeddings no shorter than the target's context.
"""

from __future__ import annotations

import logging

from draftsmith.artifacts import Descriptor, StagePlan, finish_stage, stage_output
from draftsmith.config import FixKeysConfig, TargetConfig
from draftsmith.export.convert import export_drafter, read_drafter

log = logging.getLogger(__name__)

DRAFTER_DIR = "drafter"


def run_fix_keys(cfg: FixKeysConfig, target_cfg: TargetConfig, trained: Descriptor,
                 target: Descriptor, plan: StagePlan) -> Descriptor:
    checkpoint = read_drafter(trained.path)
    family = target.figures["family"]
    context = target_cfg.context_length or target.figures.get("max_position_embeddings")
    extras = {"speculative_tokens": cfg.speculative_tokens,
              "verifier": {"name_or_path": target.path,
                           "architectures": target.figures.get("architectures", [])}}
    with stage_output(plan) as out:
        config = export_drafter(checkpoint.tensors, checkpoint.config, cfg.format, family,
                                out / DRAFTER_DIR, context_length=context, extras=extras)
    written = (config.get("eagle_config") or config)["eagle_aux_hidden_state_layer_ids"]
    log.info("fix-keys: %s drafter written to %s and validated; aux layers %s (outputs) are "
             "written as %s for a %s-family target", cfg.format, out / DRAFTER_DIR,
             checkpoint.config.aux_layer_ids, written, family)
    return finish_stage(plan, figures={
        "format": cfg.format, "drafter_dir": str(out / DRAFTER_DIR),
        "canonical_aux_layer_ids": checkpoint.config.aux_layer_ids,
        "written_aux_layer_ids": written, "target_family": family,
    })
