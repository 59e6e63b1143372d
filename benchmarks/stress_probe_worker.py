"""The torchrun training worker with a probe, for `benchmarks/stress_distributed.py --probe`:
each rank prints how many gloo worker threads (pt_gloo_runloop) it runs before and after
`Dist.close`, the threads that must not run on into Python's shutdown (issue 29).

With STRESS_SLOW_EXIT=SECONDS, rank 1 ends with an exit handler that holds the GIL that long
(registered before torch is imported, so it runs last): the window in which a gloo thread that
still finishes work waits for the GIL while Python shuts down, as in
benchmarks/gloo_exit_race.py, but with nothing else added to the training."""

from __future__ import annotations

import os
import sys

if os.environ.get("STRESS_SLOW_EXIT") and os.environ.get("RANK") == "1":
    import atexit
    import time

    def _hold_the_gil(seconds: float) -> None:
        until = time.monotonic() + seconds
        while time.monotonic() < until:
            sum(range(2_000_000))  # C, GIL held, between short checks of the clock

    atexit.register(_hold_the_gil, float(os.environ["STRESS_SLOW_EXIT"]))

from draftsmith.distributed import Dist  # noqa: E402 - after the exit handler
from draftsmith.train import worker  # noqa: E402


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
