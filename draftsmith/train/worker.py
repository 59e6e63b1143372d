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
    try:
        result = train_loop(cfg, Descriptor.model_validate(job["hidden"]),
                            Descriptor.model_validate(job["merged"]),
                            Descriptor.model_validate(job["target"]), Path(job["out"]), dist,
                            online, drafter)
        if dist.is_main:
            atomic_write_json(Path(job["out"]) / "torchrun_result.json", result)
        dist.barrier()
    except InputError as err:  # tell the parent it is the input's fault, not a crash
        from draftsmith.train.launch import INPUT_ERROR_FILE

        atomic_write_json(Path(job["out"]) / INPUT_ERROR_FILE.format(rank=dist.rank),
                          {"type": type(err).__name__, "message": str(err)})
        raise
    finally:
        dist.close()


if __name__ == "__main__":
    main(sys.argv[1])
