"""A GPU host that dies mid-training, for tests/test_multi_host.py: on the PYTHONPATH of one
host's Prefect worker only, so it loads in every Python process that host starts (its flow
runs, torchrun, the training ranks).

While the file named by DRAFTSMITH_TEST_KILL_FILE exists, a training rank on this host
SIGKILLs itself as its Nth optimiser step begins (N is the file's content), after deleting the
file: the host's node dies once, and its retry trains on.
"""

from __future__ import annotations

import os

TRIGGER = os.environ.get("DRAFTSMITH_TEST_KILL_FILE")


def _patch(module) -> None:
    import signal

    real_step = module.MasterWeightAdamW.step
    calls = {"n": 0}

    def dying_step(self, clip):
        calls["n"] += 1
        try:
            die_at = int(open(TRIGGER).read())  # noqa: SIM115 - a tiny file, read once a step
        except (FileNotFoundError, ValueError):
            die_at = None
        if calls["n"] == die_at:
            os.unlink(TRIGGER)
            os.kill(os.getpid(), signal.SIGKILL)
        return real_step(self, clip)

    module.MasterWeightAdamW.step = dying_step


if TRIGGER:
    import importlib.abc
    import importlib.machinery
    import sys

    class _PatchOptimiser(importlib.abc.MetaPathFinder):
        """Patches draftsmith.train.optim as it is imported (the ranks import it late)."""

        def find_spec(self, name, path, target=None):
            if name != "draftsmith.train.optim":
                return None
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            if spec is None or spec.loader is None:
                return spec
            load = spec.loader.exec_module

            def exec_module(module):
                load(module)
                _patch(module)

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _PatchOptimiser())
