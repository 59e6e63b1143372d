"""A torchrun training worker whose rank RANK kills itself with signal SIG at the end of a run
(`python tests/train_worker_dies_at_exit.py RANK SIG WHEN JOB.json`):
- `before-result`: its training is done, the result not yet recorded;
- `after-close`: after the final barrier and `Dist.close`, as the FSDP rank of issue 29 that
  aborted on its way out.
Every rank logs how many gloo worker threads it runs before and after `Dist.close` (the
threads the close must join)."""

from __future__ import annotations

import logging
import os
import signal
import sys

from draftsmith.distributed import Dist
from draftsmith.train import worker

log = logging.getLogger("draftsmith.test_worker")


def gloo_threads() -> int:
    tasks = "/proc/self/task"
    return sum(open(f"{tasks}/{t}/comm").read().strip() == "pt_gloo_runloop"
               for t in os.listdir(tasks))


def main(rank: int, sig: int, when: str, job: str) -> None:
    real_loop, real_close = worker.train_loop, Dist.close

    def train_loop(*args, **kwargs):
        result = real_loop(*args, **kwargs)
        if when == "before-result" and int(os.environ["RANK"]) == rank:
            os.kill(os.getpid(), sig)
        return result

    def close(self, failed=False):
        before = gloo_threads()
        real_close(self, failed)
        log.info("gloo worker threads: %d before close, %d after", before, gloo_threads())
        if when == "after-close" and self.rank == rank:
            os.kill(os.getpid(), sig)

    worker.train_loop, Dist.close = train_loop, close
    worker.main(job)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(getattr(signal, sys.argv[2])), sys.argv[3], sys.argv[4])
