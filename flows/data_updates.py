"""New data that sticks. A dataset update (the payload of a draftsmith.dataset.updated event, or
the form's `dataset` field) is recorded in a Prefect Variable of the pipeline,
`draftsmith-<name>-data` ({source: path}), and every run of that pipeline reads its sources
from there: a later scheduled or UI run trains on the new data, not on the config's old files.
Delete the variable (`prefect variable unset draftsmith-<name>-data`) to go back to the
config's files."""

from __future__ import annotations

from pathlib import Path

from prefect import get_run_logger
from prefect.variables import Variable

from draftsmith.artifacts import sha256_file
from draftsmith.config import ConfigError, DatasetUpdate, PipelineConfig, with_source

DATASET_EVENT = "draftsmith.dataset.updated"


def dataset_event(path: str | Path, source: str | None = None) -> dict:
    """The event that says a dataset file has new content (the pipeline trigger's input):
    what `draftsmith prefect notify-new-data` and the data watcher emit."""
    path = Path(path).resolve()
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such dataset file")
    name = source or path.stem
    return {"event": DATASET_EVENT,
            "resource": {"prefect.resource.id": f"draftsmith.dataset.{name}",
                         "prefect.resource.name": name},
            "payload": {"source": name, "path": str(path), "sha256": sha256_file(path)}}


def variable_name(config: PipelineConfig) -> str:
    return f"draftsmith-{config.pipeline_name}-data"


def per_source(name: str, value_type: type, expected: str, fix: str) -> dict:
    """A Prefect variable that holds {source name: value_type}, or {} when it is not set;
    another content is refused naming the variable, what it should hold and the fix."""
    value = Variable.get(name, default=None)
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(v, value_type) for v in value.values()):
        raise ConfigError(f"Prefect variable {name} holds {value!r}; expected {expected}: {fix}")
    return value


def recorded(config: PipelineConfig) -> dict[str, str]:
    """The updates recorded for this pipeline: source name -> the file it reads."""
    return per_source(variable_name(config), str, "{source name: dataset file}",
                      "fix it in the UI (Variables) or delete it to read the config's files")


def apply(config: PipelineConfig, dataset: DatasetUpdate | None) -> PipelineConfig:
    """The config with every recorded update applied, `dataset` first recorded (it sticks)."""
    updates = recorded(config)
    name = variable_name(config)
    if dataset is not None:
        if not Path(dataset.path).is_file():
            raise ConfigError(f"dataset update {dataset.source}={dataset.path}: no such file on "
                              "this worker; the file must lie where the workers can read it")
        updates[dataset.source] = dataset.path
        Variable.set(name, updates, overwrite=True)
        get_run_logger().info("new data: source %s reads %s from now on (Prefect variable %s)",
                              dataset.source, dataset.path, name)
    for source, path in updates.items():
        if not Path(path).is_file():
            raise ConfigError(
                f"data source {source}: reads {path} since a new-data update (Prefect variable "
                f"{name}), and that file is gone; restore it, record a new one (draftsmith "
                f"prefect notify-new-data), or delete the variable to read the config's files")
        config = with_source(config, source, path)
    if updates and dataset is None:
        get_run_logger().info("data: %s (recorded updates, Prefect variable %s)",
                              ", ".join(f"{s} reads {p}" for s, p in updates.items()), name)
    return config
