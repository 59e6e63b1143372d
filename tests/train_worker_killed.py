"""A torchrun training worker that SIGKILLs itself as its Nth optimiser step begins, as a
machine that dies mid-run (`python tests/train_worker_killed.py N JOB.json`; every rank dies at
the same step, after that step's backward pass)."""

from __future__ import annotations

import os
import signal
import sys

from draftsmith.train import worker
from draftsmith.train.optim import MasterWeightAdamW


def main(die_at: int, job: str) -> None:
    real_step = MasterWeightAdamW.step
    calls = {"n": 0}

    def dying_step(self, clip):
        calls["n"] += 1
        if calls["n"] == die_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return real_step(self, clip)

    MasterWeightAdamW.step = dying_step
    worker.main(job)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
