"""What a stage shows about its output (a table, a markdown page, log lines), and the helpers
its report formatting shares. Each stage formats its own reports beside its work
(draftsmith/<package>/report.py); the stage table (draftsmith/stages.py) points to them."""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal


@dataclass(frozen=True)
class Report:
    """Something a stage shows about its output: a table or a markdown page (a Prefect
    artifact under flows) and the lines it adds to the run log. `key` names it within its
    pipeline; the artifact's key is scoped to the pipeline (artifact_key)."""

    kind: Literal["table", "markdown", "log"]
    description: str = ""
    key: str | None = None
    rows: list[dict[str, Any]] = field(default_factory=list)
    text: str = ""
    log_lines: list[str] = field(default_factory=list)


def rounded(value: Any, digits: int = 4) -> Any:
    """Floats rounded for reading (4 decimals; 1 from 1000 on), anything else as it is."""
    if isinstance(value, float):
        return round(value, 1 if abs(value) >= 1000 else digits)
    return value


def embedded_image(path: Path, alt: str) -> str:
    """A PNG as a markdown image with a data: URI: the chart travels inside the report, so the
    Prefect UI shows it wherever it runs, not only on the machine that holds the file."""
    data = base64.b64encode(path.read_bytes()).decode("ascii")
    return f"![{alt}](data:image/png;base64,{data})"
