"""Logging for the engine, configured once by the CLI or the flow.

The engine logs to "draftsmith.*" loggers. Left alone they inherit the root logger's WARNING
level and their progress is invisible (a seeds' run trained for hours that way), so the
"draftsmith" logger gets an explicit level and one stderr handler; optionally a file too,
flushed line by line.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_MARK = "_draftsmith_handler"


def configure_logging(level: int | str = logging.INFO, log_file: str | Path | None = None,
                      console: bool = True) -> None:
    """console=False when Prefect already prints these loggers (PREFECT_LOGGING_EXTRA_LOGGERS)."""
    logger = logging.getLogger("draftsmith")
    logger.setLevel(level)
    existing = [h for h in logger.handlers if getattr(h, _MARK, None)]
    if console and not any(type(h) is logging.StreamHandler for h in existing):
        _add(logger, logging.StreamHandler(sys.stderr))
    if log_file and not any(isinstance(h, logging.FileHandler)
                            and h.baseFilename == str(Path(log_file).resolve()) for h in existing):
        Path(log_file).parent.mkdir(parents=True, exist_ok=True)
        _add(logger, logging.FileHandler(log_file))  # flushes after every record


def _add(logger: logging.Logger, handler: logging.Handler) -> None:
    handler.setFormatter(logging.Formatter(FORMAT, datefmt="%H:%M:%S"))
    setattr(handler, _MARK, True)
    logger.addHandler(handler)
