"""The run plan: for each stage, its cache key and directory, and whether it runs, is reused,
was pruned, or has to be recomputed first. Decided here, in the engine, once per run; the
Prefect flow (flows/pipeline.py) and `draftsmith run` are loops over it, and `draftsmith plan
CONFIG` prints it.

A stage's key hashes its section's `keyed` settings (draftsmith/config.py), the extra settings
its table entry names (draftsmith/stages.py), the content fingerprints of what it reads, and the
format version. So changing the benchmark settings re-runs only the benchmark, and new data
re-runs everything from generate on. Operational settings (devices, concurrency, timeouts,
thresholds) are left out: moving a run or driving it harder never redoes finished work.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from draftsmith import retention, stages
from draftsmith.artifacts import (
    MANIFEST,
    Descriptor,
    StagePlan,
    load_descriptor,
    plan_stage,
    read_descriptor,
)
from draftsmith.config import ConfigError, PipelineConfig, key_settings
from draftsmith.data.source_fingerprints import data_descriptors
from draftsmith.stages import DATA, Inputs, Stage

log = logging.getLogger(__name__)

__all__ = ["RunPlan", "Step", "data_descriptors", "finished_outputs", "key_material",
           "run_in_process", "select_stages", "stage_plan"]


def key_material(config: PipelineConfig, stage_name: str) -> dict[str, Any]:
    """The settings `stage_name`'s key covers: its section's keyed fields, then its extras."""
    stage = stages.get(stage_name)
    if stage.name != stage_name:
        raise ValueError(f"unknown stage {stage_name!r}: key_material takes the stage's name, "
                         f"{stage.name!r}")
    material: dict[str, Any] = {}
    if stage.section:
        material[stage.section] = key_settings(getattr(config, stage.section))
    material.update(stage.key_extras(config))
    return material


def stage_plan(config: PipelineConfig, stage_name: str, outputs: Inputs,
               data: list[Descriptor] | None = None) -> StagePlan:
    """Where `stage_name` writes, given the descriptors of what it reads. `data`: the data
    files' fingerprints (hashed here when not given)."""
    stage = stages.get(stage_name)
    named: dict[str, Any] = {}
    inputs: list[Descriptor] = []
    present = stage.inputs_from(outputs)
    for name in stage.inputs:
        if name == DATA:
            files = data if data is not None else data_descriptors(config)
            inputs += files
            named[DATA] = [d.fingerprint for d in files]
        elif name in present:
            inputs.append(outputs[name])
            named[name] = outputs[name].fingerprint
    material = key_material(config, stage.name)
    plan = plan_stage(config.run_root, stage.name, material, inputs)
    return plan.model_copy(update={"material": material, "input_fingerprints": named})


def select_stages(only: str | None = None, start: str | None = None,
                  stop: str | None = None) -> list[str]:
    """The stages a run executes, from --only / --from / --to (either spelling of a name)."""
    order = stages.names()

    def index(flag: str, name: str) -> int:
        try:
            return order.index(stages.get(name).name)
        except ConfigError:
            raise ConfigError(f"{flag} {name}: unknown stage; choose from "
                              + ", ".join(s.label for s in stages.STAGES)) from None

    if only and (start or stop):
        raise ConfigError("--only cannot be combined with --from/--to")
    if only:
        return [order[index("--only", only)]]
    first = index("--from", start) if start else 0
    last = index("--to", stop) if stop else len(order) - 1
    if first > last:
        raise ConfigError(f"--from {start} comes after --to {stop}")
    return order[first : last + 1]


@dataclass
class Step:
    """A stage to execute: its plan, what it reads, and the stages that must run with it in one
    process (a served deploy and the benchmark that measures its live server)."""

    stage: Stage
    plan: StagePlan
    inputs: Inputs
    reason: str
    group: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.stage.name


@dataclass
class PreviewRow:
    stage: str
    key: str | None
    status: str  # cached, reused, pruned, to run, missing
    reason: str


class RunPlan:
    """One run of the pipeline over the selected stages (all by default).

    Iterate `steps()` and execute each step's stage (in this process or on a GPU worker), then
    `record()` what it wrote: the plan decides the next step from the recorded outputs. Stages
    that are not selected are read from disk; outputs deleted by retention are recomputed only
    when a stage that reads them has to run; retention is applied as stages finish."""

    def __init__(self, config: PipelineConfig, target: Descriptor,
                 selected: list[str] | None = None, data: list[Descriptor] | None = None):
        self.config = config
        order = stages.names()
        self.outputs: Inputs = {stages.TARGET: target}
        self.results: dict[str, dict[str, Any]] = {}
        first = 0
        if config.deploy.drafter:  # a drafter made elsewhere: deploy and benchmark it
            from draftsmith.export.stage import external_drafter  # reads it: imports torch

            first = order.index(EXTERNAL_FROM)
            selected = external_selection(config, selected)
            self._set("export", "External", external_drafter(config.deploy.drafter, target))
        self.selected = [stages.get(s).name for s in (selected or order)]
        last = max(order.index(s) for s in self.selected)
        self.order: list[Stage] = list(stages.STAGES[first: last + 1])
        self._pruned: set[str] = set()
        self._data = data  # the data files' fingerprints, when the caller hashed them
        self._plans: dict[tuple[str, ...], StagePlan] = {}
        for warning in config.warnings():
            log.warning("config: %s", warning)

    # -- keys -----------------------------------------------------------------------------

    def data(self) -> list[Descriptor]:
        """The data files' fingerprints, hashed once per run."""
        if self._data is None:
            self._data = data_descriptors(self.config)
        return self._data

    def plan_for(self, name: str) -> StagePlan:
        """The stage's plan on the outputs recorded so far, computed once for each set of
        input fingerprints (keys hash file contents: fine-tuning drafters, prompt files)."""
        stage = stages.get(name)
        memo = (stage.name, *(d.fingerprint for d in stage.inputs_from(self.outputs).values()))
        if memo not in self._plans:
            data = self.data() if DATA in stage.inputs else None
            self._plans[memo] = stage_plan(self.config, stage.name, self.outputs, data)
        return self._plans[memo]

    def inputs_of(self, stage: Stage) -> Inputs:
        return stage.inputs_from(self.outputs)

    def inputs_of_group(self, group: list[str]) -> Inputs:
        """What the stages of one execution read from outside it (a served deploy's benchmark
        reads train's output too, beside deploy's)."""
        names = [n for s in group for n in stages.get(s).stage_inputs() if n not in group]
        return {name: self.outputs[name] for name in names if name in self.outputs}

    def group_of(self, stage: Stage) -> list[str]:
        """The stages one execution of `stage` runs: itself, and the stage after it when its
        output is a live server that stage measures."""
        index = self.order.index(stage)
        after = self.order[index + 1] if index + 1 < len(self.order) else None
        if stage.live(self.config) and after is not None and after.name in self.selected:
            return [stage.name, after.name]
        return [stage.name]

    # -- the loop ---------------------------------------------------------------------------

    def steps(self) -> Iterator[Step]:
        last = self.order[-1].name
        for stage in self.order:
            name = stage.name
            if name in self.results and self.results[name]["state"] != "Pruned":
                continue  # it ran with the stage before it (a served deploy's benchmark)
            plan = self.plan_for(name)
            recorded = retention.pruned_descriptor(plan)
            if recorded is not None and name != last:
                self._pruned.add(name)
                self._set(name, "Pruned", recorded)
                log.info("stage %s: deleted by retention after use (%s)", name, plan.dir)
                continue
            if name not in self.selected:
                self._set(name, "Reused", load_descriptor(plan))
                continue
            if not plan.is_complete():
                for needed in stage.stage_inputs():
                    if needed in self._pruned:  # its files were deleted: this stage reads them
                        self._pruned.discard(needed)
                        log.info("stage %s reads %s, deleted by retention; recomputing it",
                                 name, needed)
                        needed_stage = stages.get(needed)
                        yield Step(needed_stage, self.plan_for(needed),
                                   self.inputs_of(needed_stage),
                                   f"deleted by retention; {name} reads it", [needed])
                plan = self.plan_for(name)
            reason = ("complete output found" if plan.is_complete()
                      else self.why_it_runs(stage, plan))
            group = self.group_of(stage)
            yield Step(stage, plan, self.inputs_of_group(group), reason, group)

    def record(self, name: str, state: str, descriptor: Descriptor) -> None:
        """What a stage's execution returned (Completed, Cached, ...); applies retention."""
        self._set(name, state, descriptor)
        for stage in stages.STAGES:
            if stage.retention is None or stage.name != name:
                continue
            deletes, setting = stage.retention
            if getattr(self.config.retention, setting) and deletes in self.outputs:
                retention.prune(self.plan_for(deletes),
                                f"(retention.{setting}: {name} has finished)")

    def _set(self, name: str, state: str, descriptor: Descriptor) -> None:
        self.outputs[name] = descriptor
        self.results[name] = {"state": state, "descriptor": descriptor.model_dump()}

    # -- explaining it ------------------------------------------------------------------------

    def why_it_runs(self, stage: Stage, plan: StagePlan) -> str:
        """Why a stage has no complete output for its key: the settings or inputs that differ
        from the closest complete output of the same stage, or that there is none."""
        best: tuple[int, list[str]] | None = None
        for manifest in sorted(plan.dir.parent.glob(f"*/{MANIFEST}")):
            try:
                before = json.loads(manifest.read_text()).get("key_material")
            except (OSError, ValueError):
                continue
            if not before:
                continue
            changes = differences({"settings": before.get("config"),
                                    "inputs": before.get("inputs")},
                                   {"settings": plan.material,
                                    "inputs": plan.input_fingerprints})
            if best is None or len(changes) < best[0]:
                best = (len(changes), changes)
        if best is None:
            return "no complete output of this stage yet"
        shown = ", ".join(best[1][:4]) + (", ..." if len(best[1]) > 4 else "")
        return f"changed since the closest finished output: {shown}"

    def preview(self) -> list[PreviewRow]:
        """What a run would do now, without running anything: each stage, its key (unknown
        while a stage it reads has yet to run), and cached / to run / reused and why."""
        rows: list[PreviewRow] = []
        if "export" in self.results:  # a drafter made elsewhere
            rows.append(PreviewRow("export", self.outputs["export"].key[:16], "external",
                                   f"deploy.drafter: {self.outputs['export'].path}"))
        pending: dict[str, str] = {}  # stages whose output is not known yet -> the first cause
        blocked: set[str] = set()  # ... because a stage it needs is neither selected nor done
        for stage in self.order:
            name, selected = stage.name, stage.name in self.selected
            waiting = [i for i in stage.stage_inputs() if i in pending]
            if waiting:
                pending[name] = pending[waiting[0]]
                if not selected or any(i in blocked for i in waiting):
                    blocked.add(name)
                    rows.append(PreviewRow(stage.label, None, "missing",
                                           f"needs {pending[name]}, which is not selected and "
                                           f"not complete (--to {pending[name]} first)"))
                else:
                    rows.append(PreviewRow(stage.label, None, "to run",
                                           f"after {pending[name]}: its key follows that "
                                           "output"))
                continue
            plan = self.plan_for(name)
            recorded = retention.pruned_descriptor(plan)
            if plan.is_complete():
                self.outputs[name] = read_descriptor(plan)
                rows.append(PreviewRow(stage.label, plan.key,
                                       "cached" if selected else "reused",
                                       f"complete output at {plan.dir}"))
            elif recorded is not None:
                self.outputs[name] = recorded
                rows.append(PreviewRow(stage.label, plan.key, "pruned",
                                       "deleted by retention after use; recomputed only when a "
                                       "stage that reads it runs"))
            else:
                pending[name] = stage.label
                if selected:
                    rows.append(PreviewRow(stage.label, plan.key, "to run",
                                           self.why_it_runs(stage, plan)))
                else:
                    blocked.add(name)
                    rows.append(PreviewRow(stage.label, plan.key, "missing",
                                           "not selected and not complete: run it first "
                                           f"(--to {stage.label})"))
        return rows


EXTERNAL_FROM = "deploy"  # the first stage a run of a drafter made elsewhere runs


def external_selection(config: PipelineConfig, selected: list[str] | None) -> list[str]:
    """The stages a run of deploy.drafter executes: deploy and benchmark, or the one of them
    picked; a stage before deploy is refused, since no stage of this run makes the drafter."""
    order = stages.names()
    first = order.index(EXTERNAL_FROM)
    if not selected:
        return order[first:]
    before = [s for s in selected if order.index(stages.get(s).name) < first]
    if before:
        raise ConfigError(
            f"deploy.drafter={config.deploy.drafter} deploys a drafter made elsewhere, so this "
            f"run is {' and '.join(order[first:])} only; {', '.join(before)} cannot run. Pick "
            "--from deploy (or nothing), or unset deploy.drafter to train a drafter")
    return list(selected)


def differences(before: Any, now: Any) -> list[str]:
    """Dotted paths where two JSON-like values differ, with both values for short leaves."""
    return _differences(json.loads(json.dumps(before, default=str)),
                        json.loads(json.dumps(now, default=str)), "")


def _differences(before: Any, now: Any, path: str) -> list[str]:
    if isinstance(before, dict) and isinstance(now, dict):
        out = []
        for key in sorted(set(before) | set(now)):
            out += _differences(before.get(key), now.get(key), f"{path}.{key}" if path else key)
        return out
    if before == now:
        return []
    if isinstance(before, list) or isinstance(now, list) or len(repr(now)) > 40:
        return [path]
    return [f"{path} {before!r} -> {now!r}"]


def run_in_process(config: PipelineConfig, target: Descriptor,
                   selected: list[str] | None = None) -> RunPlan:
    """Execute the plan in this process with no orchestration: each step's preflight, then its
    engine function. What each stage cost is in its descriptor (draftsmith/stage_cost.py)."""
    run = RunPlan(config, target, selected)
    for step in run.steps():
        started = time.monotonic()
        if step.plan.is_complete() and not step.stage.live(config):
            descriptor, state = read_descriptor(step.plan), "Cached"
        else:
            step.stage.preflight(config, step.inputs, step.plan)
            descriptor = step.stage.execute(config, step.inputs, step.plan)
            state = "Completed"
        run.record(step.name, state, descriptor)
        log.info("stage %s: %s in %.1fs (%s)", step.name, state, time.monotonic() - started,
                 descriptor.path)
    return run


def finished_outputs(config: PipelineConfig, target: Descriptor,
                     upto: str) -> dict[str, Descriptor]:
    """Descriptors of the finished stages up to `upto`, read from disk; the error names the
    first stage that is not complete for this config."""
    upto = stages.get(upto).name
    run = RunPlan(config, target, [upto])
    for stage in run.order:
        run.outputs[stage.name] = load_descriptor(run.plan_for(stage.name))
    return dict(run.outputs)

