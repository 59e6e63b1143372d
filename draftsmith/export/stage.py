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
from draftsmith.export.formats import layout_named
from draftsmith.figures import ExportFigures, TargetFigures
from draftsmith.model.kinds import kind_named

log = logging.getLogger(__name__)


def drafter_dir_name(kind: str) -> str:
    """The exported drafter's directory: named after the kind's vLLM method (eagle3-drafter,
    dflash-drafter). Given a draft path and no `method`, vLLM 0.34 takes the method from the
    path: the first of "eagle-" (EAGLE-1), "eagle3", "dflash" in it (docs/engines/vllm.md)."""
    return f"{kind_named(kind).vllm_method}-drafter"


def run_export(cfg: ExportConfig, target_cfg: TargetConfig, trained: Descriptor,
               target: Descriptor, plan: StagePlan) -> Descriptor:
    checkpoint = read_drafter(trained.path)
    facts = TargetFigures.of(target)
    context = target_cfg.context_length or facts.max_position_embeddings
    extras = {"speculative_tokens": cfg.speculative_tokens,
              "verifier": {"name_or_path": target.path, "architectures": facts.architectures}}
    if facts.provenance:  # where the target came from travels with the drafter
        extras["target_provenance"] = facts.provenance
    dir_name = drafter_dir_name(checkpoint.kind)
    with stage_output(plan) as out:
        config = export_drafter(checkpoint.tensors, checkpoint.config, cfg.format, facts.family,
                                out / dir_name, context_length=context, extras=extras)
    written = layout_named(cfg.format, checkpoint.kind).written_layer_ids(config)
    log.info("export: %s %s drafter written to %s and validated; aux layers %s (outputs) are "
             "written as %s for a %s-family target", cfg.format, checkpoint.kind,
             out / dir_name, checkpoint.config.aux_layer_ids, written, facts.family)
    figures = ExportFigures(format=cfg.format, drafter_dir=str(out / dir_name),
                            canonical_aux_layer_ids=checkpoint.config.aux_layer_ids,
                            written_aux_layer_ids=written, target_family=facts.family)
    return finish_stage(plan, figures=figures.model_dump())
