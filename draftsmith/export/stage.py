"""Stage `export` (known as fix-keys): the trained drafter in the serving engine's layout, and
validated against it.

The exported config carries the aux layer ids the engine needs for this target's family, and a
max_position_embeddings no shorter than the target's context.
"""

from __future__ import annotations

import logging

from draftsmith.artifacts import Descriptor, StagePlan, finish_stage, stage_output
from draftsmith.config import ExportConfig, TargetConfig
from draftsmith.export.convert import export_drafter, read_drafter
from draftsmith.figures import ExportFigures, TargetFigures

log = logging.getLogger(__name__)

DRAFTER_DIR = "drafter"


def run_export(cfg: ExportConfig, target_cfg: TargetConfig, trained: Descriptor,
               target: Descriptor, plan: StagePlan) -> Descriptor:
    checkpoint = read_drafter(trained.path)
    facts = TargetFigures.of(target)
    context = target_cfg.context_length or facts.max_position_embeddings
    extras = {"speculative_tokens": cfg.speculative_tokens,
              "verifier": {"name_or_path": target.path, "architectures": facts.architectures}}
    if facts.provenance:  # where the target came from travels with the drafter
        extras["target_provenance"] = facts.provenance
    with stage_output(plan) as out:
        config = export_drafter(checkpoint.tensors, checkpoint.config, cfg.format, facts.family,
                                out / DRAFTER_DIR, context_length=context, extras=extras)
    layers = config.get("eagle_config") or config  # DFlash: aux_hidden_state_layer_ids
    written = layers.get("eagle_aux_hidden_state_layer_ids",
                         layers.get("aux_hidden_state_layer_ids"))
    log.info("export: %s drafter written to %s and validated; aux layers %s (outputs) are "
             "written as %s for a %s-family target", cfg.format, out / DRAFTER_DIR,
             checkpoint.config.aux_layer_ids, written, facts.family)
    figures = ExportFigures(format=cfg.format, drafter_dir=str(out / DRAFTER_DIR),
                            canonical_aux_layer_ids=checkpoint.config.aux_layer_ids,
                            written_aux_layer_ids=written, target_family=facts.family)
    return finish_stage(plan, figures=figures.model_dump())
