"""The torchrun training worker with a probe, for `benchmarks/stress_distributed.py --probe`:
each rank prints how many gloo worker threads (pt_gloo_runloop) it runs before and after
`Dist.close`, the threads that must not run on into Python's shutdown (issue 29)."""

from __future__ import annotations

import os
import sys

from draftsmith.distributed import Dist
from draftsmith.train import worker


def gloo_threads() -> int:
    tasks = "/proc/self/task"
    return sum(open(f"{tasks}/{t}/comm").read().strip() == "pt_gloo_runloop"
               for t in os.listdir(tasks))


def main(job: str) -> None:
    real_close = Dist.close

    def close(self, *args, **kwargs):
        before = gloo_threads()
        real_close(self, *args, **kwargs)
        print(f"rank{self.rank} probe: {before} gloo worker threads before Dist.close, "
              f"{gloo_threads()} after", flush=True)

    Dist.close = close
    worker.main(job)


if __name__ == "__main__":
    main(sys.argv[1])
