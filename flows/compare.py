"""Several variants of one pipeline config, each a pipeline run (a child flow run), and one
comparison table artifact (draftsmith/compare.py): what `draftsmith compare` runs, and what the
`draftsmith-compare` deployment runs from the UI.
"""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from pydantic import BaseModel, Field

from draftsmith.compare import (
    Variant,
    check_variants,
    comparison_markdown,
    comparison_row,
    write_comparison,
)
from draftsmith.config import form_config
from draftsmith.stages import artifact_key
from flows.pipeline import StageSelection, pipeline


class VariantForm(BaseModel):
    """One variant, as the run form asks for it."""

    name: str = Field(..., description="Names the variant's row and its runs' reports.")
    overrides: list[str] = Field(default_factory=list, description=(
        "key=value settings over the base config, e.g. train.epochs=2 or drafter.kind=dflash"))


@flow(name="draftsmith-compare")
def compare(config: str = "tiny", variants: list[VariantForm] = (),
            overrides: list[str] = (), stages: StageSelection = (),
            full_config: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Run the pipeline once per variant, one after the other on one run root (the stages a
    variant leaves unchanged are Cached), and publish one table of their figures.

    Args:
        config: The base pipeline YAML: a path this worker can read, or a bundled example.
        variants: Each variant's name and its overrides over the base config.
        overrides: Settings every variant gets, e.g. benchmark.splits=[dev] while deciding.
        stages: The stages each variant runs (empty: all), e.g. generate to train to compare
            training alone; the ones before the first picked must be complete.
        full_config: Advanced: the whole base config as JSON; `config` is then not read.
    """
    chosen = [Variant(v.name, tuple(v.overrides)) for v in variants]
    check_variants(chosen)
    base = form_config(config, full_config, list(overrides))
    logger = get_run_logger()
    rows = []
    for variant in chosen:
        logger.info("compare: variant %s (%s)", variant.name,
                    " ".join(variant.overrides) or "the base config")
        results = pipeline(config=config, full_config=full_config, stages=list(stages),
                           overrides=[*overrides, *variant.run_overrides(base.pipeline_name)])
        rows.append(comparison_row(variant, results))
        logger.info("compare: %s", rows[-1])
    path = write_comparison(base.run_root, base.pipeline_name, rows, chosen)
    title = f"{base.pipeline_name}: {len(chosen)} variants"
    create_table_artifact(rows, key=artifact_key(base, "comparison"),
                          description=f"compare: {title} (rows also in {path})")
    create_markdown_artifact(comparison_markdown(title, rows),
                             key=artifact_key(base, "comparison-page"),
                             description=f"compare: {title}")
    return rows
