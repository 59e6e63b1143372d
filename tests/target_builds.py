"""The builtin targets the session's tests need, built in a background process from the first
test on (tests/conftest.py `target_builds`).

The tiny demo target trains for 2-3 minutes on one thread, and SmolLM2 is fetched and converted
in about half a minute. One process builds them for the whole run: the first pytest-xdist worker
to start a test starts it, into the cache every worker shares. It is the same `resolve_target`
call the pipeline makes, with the run's DRAFTSMITH_CACHE: a test that needs a target still
being built here waits on the build's lock (draftsmith/target.py `build_once`) and then finds
it; one that failed to build here (or was stopped, when the worker that started the build
finished first) is built again there, where its error reaches the test.

Run as `python -m tests.target_builds MODEL...` with DRAFTSMITH_CACHE set.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from draftsmith.smollm2_target import BUILTIN_SMOLLM2
from draftsmith.target import BUILTIN_TINY

# The fixtures whose tests need each target (pytest lists a test's fixtures transitively).
NEEDED_BY = {BUILTIN_TINY: "tiny_target_cache", BUILTIN_SMOLLM2: "smollm2_target"}
REPO = Path(__file__).resolve().parent.parent


def needed(fixture_names: set[str]) -> list[str]:
    """The targets that tests using these fixtures need, the tiny one first (it is needed
    first, by the e2e and vLLM tests)."""
    return [model for model, fixture in NEEDED_BY.items() if fixture in fixture_names]


class TargetBuilds:
    """One background process building `models` into `cache`, one after the other."""

    def __init__(self, cache: Path, models: list[str]):
        self.process: subprocess.Popen | None = None
        if models:
            with open(cache.parent / f"{cache.name}-builds.log", "w") as log:
                self.process = subprocess.Popen(
                    [sys.executable, "-m", "tests.target_builds", *models], cwd=REPO,
                    env={**os.environ, "DRAFTSMITH_CACHE": str(cache)}, stdout=log,
                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()


def main(models: list[str]) -> int:
    import logging

    from draftsmith.config import TargetConfig
    from draftsmith.target import resolve_target

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    failed = 0
    for model in models:
        try:
            resolve_target(TargetConfig(model=model))
        except Exception:  # noqa: BLE001 (reported here, raised again by the test's own build)
            logging.exception("building %s failed", model)
            failed += 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
