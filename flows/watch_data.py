"""The data watcher: starts a pipeline run when a data source's file changes.

`draftsmith prefect setup --watch-data SECONDS` deploys this flow on the cpu pool
(`draftsmith-watch-data/cpu`) with an interval schedule, and the same parameters as the
pipeline deployment. Each look fingerprints every source read from a file (the config's, with
the new-data updates recorded for the pipeline applied) and compares them with the last look,
kept in the Prefect Variable `draftsmith-<pipeline>-watched`. For each file whose content
changed at the same path, it emits `draftsmith.dataset.updated`, the event
`draftsmith prefect notify-new-data` emits: the pipeline deployment's trigger starts a run in
which that source reads it, and generate asks the target only for the prompts no run answered.

The first look only records what it sees; so does a look that finds a source reading another
file (a new-data update started its own run). A file is hashed again only when its size or
times changed (draftsmith/fingerprints.py).
"""

from __future__ import annotations

import os
from typing import Any

# Engine logs ("draftsmith.*") go to the Prefect run log too; must be set before Prefect loads.
os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "draftsmith")

from prefect import flow, get_run_logger  # noqa: E402
from prefect.events import emit_event  # noqa: E402
from prefect.variables import Variable  # noqa: E402

from draftsmith.config import PipelineConfig, form_config  # noqa: E402
from draftsmith.fingerprints import changed_files, watched_files  # noqa: E402
from flows import data_updates  # noqa: E402
from flows.data_updates import dataset_event  # noqa: E402


def variable_name(config: PipelineConfig) -> str:
    return f"draftsmith-{config.pipeline_name}-watched"


def last_look(config: PipelineConfig) -> dict[str, dict[str, str]]:
    return data_updates.per_source(variable_name(config), dict,
                                   "{source: {path, fingerprint}}",
                                   "delete it (the next look records the files afresh)")


@flow(name="draftsmith-watch-data")
def watch_data(config: str = "tiny", overrides: list[str] = (),
               full_config: dict[str, Any] | None = None) -> dict[str, str]:
    """Look at the pipeline's data files and start a pipeline run for each whose content
    changed since the last look (a draftsmith.dataset.updated event, as notify-new-data).

    Args:
        config: The pipeline YAML the pipeline deployment runs (a path this worker can read,
            or a bundled example's name).
        overrides: Its settings as key=value, as the pipeline deployment's.
        full_config: The whole pipeline config as JSON, when the pipeline deployment has one.

    Returns the sources that changed, with the file each reads.
    """
    logger = get_run_logger()
    pipeline_config = data_updates.apply(form_config(config, full_config, list(overrides)),
                                         None)
    seen, now = last_look(pipeline_config), watched_files(pipeline_config)
    changed = changed_files(seen, now)
    for source in changed:
        path = now[source]["path"]
        emit_event(**dataset_event(path, source))
        logger.info("data source %s: %s changed (fingerprint %s, was %s): new-data event sent",
                    source, path, now[source]["fingerprint"], seen[source]["fingerprint"])
    recorded = sorted(set(now) - set(changed) - {s for s in now if seen.get(s) == now[s]})
    if recorded:
        logger.info("recorded without a run (first look, or another file since): %s",
                    ", ".join(f"{s} ({now[s]['path']})" for s in recorded))
    if not changed:
        logger.info("no data file changed: %s", ", ".join(sorted(now)) or "no file sources")
    Variable.set(variable_name(pipeline_config), now, overwrite=True)
    return {source: now[source]["path"] for source in changed}
