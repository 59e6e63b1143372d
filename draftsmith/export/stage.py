"""Stage `export` (known as fix-keys): the trained drafter in the serving engine's layout, and
validated against it.

The exported config carries the aux layer ids the engine needs for this target's family, and a
max_position_embeddings no shorter than the target's context.
"""

from __future__ import annotations

import logging
from pathlib import Path

from draftsmith.artifacts import (
    Descriptor,
    StagePlan,
    external_descriptor,
    finish_stage,
    hash_json,
    stage_output,
)
from draftsmith.config import ExportConfig, TargetConfig
from draftsmith.export.convert import export_drafter, read_drafter
from draftsmith.export.formats import layout_named
from draftsmith.export.layout import ExportError
from draftsmith.figures import ExportFigures, TargetFigures
from draftsmith.fingerprints import drafter_fingerprint
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


def external_drafter(path: str, target: Descriptor) -> Descriptor:
    """The export stage's output for a drafter made elsewhere (deploy.drafter): read and
    validated as export validates its own, checked against this target, and identified by its
    files' content, so that the deploy and benchmark keys follow the drafter, not its path."""
    files = drafter_fingerprint(path, "deploy.drafter")
    facts = TargetFigures.of(target)
    checkpoint = read_drafter(path, facts.family)
    cfg = checkpoint.config
    problems = []
    if cfg.target_hidden_size != facts.hidden_size:
        problems.append(f"it reads hidden states of size {cfg.target_hidden_size}, the "
                        f"target's are {facts.hidden_size}")
    if cfg.vocab_size != facts.vocab_size:
        problems.append(f"its vocab is {cfg.vocab_size} tokens, the target's {facts.vocab_size}")
    if max(cfg.aux_layer_ids) >= facts.num_layers:
        problems.append(f"its aux layers {cfg.aux_layer_ids} go past the target's "
                        f"{facts.num_layers} layers")
    if problems:
        raise ExportError(f"deploy.drafter={path}: a drafter for another target: "
                          + "; ".join(problems) + f" ({target.path}). Give a drafter trained "
                          "for this target, or set target.model to the one it was trained for")
    directory = str(Path(path).resolve())
    figures = ExportFigures(format=checkpoint.layout, drafter_dir=directory,
                            canonical_aux_layer_ids=cfg.aux_layer_ids,
                            target_family=facts.family, external=True)
    return external_descriptor("export", directory, hash_json(files), **figures.model_dump())
