"""One rank of a torchrun training job: `python -m draftsmith.train.worker JOB.json`."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

from draftsmith.artifacts import Descriptor, atomic_write_json
from draftsmith.config import DrafterConfig, ExtractConfig, TargetConfig, TrainConfig
from draftsmith.distributed import Dist
from draftsmith.errors import InputError
from draftsmith.train.trainer import OnlineInputs, train_loop


def main(job_path: str) -> None:
    job = json.loads(Path(job_path).read_text())
    cfg = TrainConfig.model_validate(job["train"])
    dist = Dist.from_env("nccl" if cfg.device.startswith("cuda") else "gloo",
                         always=cfg.parallel == "fsdp")
    logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                        format=f"%(asctime)s rank{dist.rank} %(name)s %(levelname)s %(message)s")
    online = None
    if job.get("online"):
        online = OnlineInputs(ExtractConfig.model_validate(job["online"]["extract"]),
                              TargetConfig.model_validate(job["online"]["target"]))
    drafter = DrafterConfig.model_validate(job["drafter"]) if job.get("drafter") else None
    failed = True
    try:
        result = train_loop(cfg, Descriptor.model_validate(job["hidden"]),
                            Descriptor.model_validate(job["merged"]),
                            Descriptor.model_validate(job["target"]), Path(job["out"]), dist,
                            online, drafter)
        # A collective every rank joins only once its share of the run is done and written:
        # the result records that, and the parent keeps a result that says so even when a
        # rank dies on its way out (draftsmith/train/launch.py).
        finished = dist.gather_objects(dist.rank)
        if dist.is_main:
            from draftsmith.train.launch import RESULT_FILE

            atomic_write_json(Path(job["out"]) / RESULT_FILE,
                              {**result, "world": dist.world, "ranks_finished": finished})
        dist.barrier()  # no rank frees the group while another still uses it
        failed = False
    except InputError as err:  # tell the parent it is the input's fault, not a crash
        from draftsmith.train.launch import INPUT_ERROR_FILE

        atomic_write_json(Path(job["out"]) / INPUT_ERROR_FILE.format(rank=dist.rank),
                          {"type": type(err).__name__, "message": str(err)})
        raise
    finally:
        dist.close(failed=failed)


if __name__ == "__main__":
    main(sys.argv[1])
