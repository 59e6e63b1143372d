"""Issue 29's abort made deterministic, with torch alone: a gloo worker thread that asks for
the GIL while Python shuts down kills its process with SIGABRT, "terminate called without an
active exception".

Rank 1 leaves main() while its last all_reduce is still running. The all_reduce ends while
rank 1 runs its last exit handler, a C function that holds the GIL for seconds (registered
before torch is imported, so it runs last), so the gloo thread that ran it is still waiting for
the GIL (to release the Python tensor the Work held) when Python starts finalizing.
- `pinned`: something keeps the process group alive past destroy_process_group(), as torch
  does under FSDP (draftsmith/distributed.py, `Dist.close`); its threads run on into
  finalization and the waiting one is ended with pthread_exit: SIGABRT.
- `freed`: destroy_process_group() drops the last reference; the group's destructor joins its
  threads (the GIL released), the waiting one finishes, and rank 1 exits 0.

Usage: python benchmarks/gloo_exit_race.py [ROUNDS]  (runs torchrun on itself; prints exit codes)
Raw output and a gdb backtrace of the aborted rank: benchmarks/results/stress_distributed/.
"""

from __future__ import annotations

import atexit
import os
import sys

if __name__ == "__main__" and os.environ.get("GLOO_EXIT_RACE_RANK_MODE"):
    atexit.register(sum, range(150_000_000))  # seconds in C, GIL held, no bytecode after it


def rank_main(mode: str) -> None:
    import time

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    kept = dist.group.WORLD if mode == "pinned" else None  # noqa: F841 - alive to the end
    t = torch.ones(1000)
    if rank == 0:
        time.sleep(1.0)  # joins rank 1's all_reduce while rank 1 runs its last exit handler
        dist.all_reduce(t)
    else:
        work = dist.all_reduce(t, async_op=True)
        del work, t
    dist.destroy_process_group()
    globals()["KEPT"] = kept  # freed only as Python finalizes


def launch(rounds: int) -> None:
    import re
    import subprocess

    for round_ in range(1, rounds + 1):
        for mode in ("pinned", "freed"):
            run = subprocess.run(
                [sys.executable, "-m", "torch.distributed.run", "--standalone",
                 "--nproc_per_node=2", __file__],
                env={**os.environ, "GLOO_EXIT_RACE_RANK_MODE": mode, "OMP_NUM_THREADS": "1"},
                capture_output=True, text=True, timeout=600)
            text = run.stdout + run.stderr
            codes = re.findall(r"exitcode\s*:\s*(-?\d+)", text)
            print(f"round {round_} {mode}: torchrun exit {run.returncode}, rank exit codes "
                  f"{sorted(set(codes)) or ['0']}, terminate message: "
                  f"{'terminate called without an active exception' in text}", flush=True)


if __name__ == "__main__":
    if os.environ.get("GLOO_EXIT_RACE_RANK_MODE"):
        rank_main(os.environ["GLOO_EXIT_RACE_RANK_MODE"])
    else:
        launch(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
