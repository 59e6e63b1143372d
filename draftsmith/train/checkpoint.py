"""Resume checkpoints, one class per parallel mode. `resume/state.pt` is the switch: it is
written last and atomically, so a kill at any moment leaves the previous checkpoint whole.

Both hold the scheduler, the position in the run (`TrainState`) and, per rank, the RNG
states and the metrics window.
- DDP: rank 0 writes the model (without the frozen target embedding) and the optimiser, whose
  float32 masters are part of its state, into state.pt.
- FSDP: every rank writes its own shards of model and optimiser to `rank<r>-step<S>.pt`; once
  all are on disk rank 0 writes state.pt naming them, then deletes the previous step's files.
  A run resumes with the same number of processes.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from draftsmith.artifacts import atomic_path, tensor_bytes
from draftsmith.distributed import Dist
from draftsmith.errors import CheckpointError, ConfigValueError
from draftsmith.model.kinds import Drafter
from draftsmith.train.optim import MasterWeightAdamW
from draftsmith.train.state import MetricsWindow, TrainState, restore_rng, rng_state

log = logging.getLogger(__name__)

RESUME_DIR = "resume"
STATE_FILE = "state.pt"
SKIPPED = ("embed_tokens.weight",)  # the frozen target embedding: rebuilt from the target


class Checkpointer:
    """What both modes share; `_save` and `_load` hold the model and optimiser parts."""

    parallel: str

    def __init__(self, out: Path, dist: Dist, drafter: Drafter,
                 optimizer: MasterWeightAdamW, scheduler: Any):
        self.path = out / RESUME_DIR / STATE_FILE
        self.dist, self.drafter = dist, drafter
        self.optimizer, self.scheduler = optimizer, scheduler

    def save(self, state: TrainState, window: MetricsWindow) -> None:
        """Every rank calls it (the per-rank parts are gathered)."""
        ranks = self.dist.gather_objects({"rng": rng_state(), "window": window.state_dict(),
                                          "trained": state.trained[self.dist.rank]})
        state.trained = [r["trained"] for r in ranks]
        common = {"parallel": self.parallel, "scheduler": self.scheduler.state_dict(),
                  "rng": [r["rng"] for r in ranks], "windows": [r["window"] for r in ranks],
                  "position": state.as_dict()}
        self._save(common)

    def load(self, window: MetricsWindow) -> TrainState | None:
        """The saved run's state, with model, optimiser, scheduler, RNG and this rank's window
        restored; None when there is nothing to resume."""
        if not self.path.is_file():
            return None
        saved = torch.load(self.path, map_location="cpu", weights_only=False)
        state = TrainState.from_dict(saved["position"])
        if state.world != self.dist.world:
            raise ConfigValueError(f"{self.path} was written by {state.world} process(es) "
                                   f"and this run has {self.dist.world} (train.nnodes x "
                                   "train.nproc_per_node): resume with "
                                   f"{state.world}, or delete it to start over")
        saved_parallel = saved.get("parallel", "ddp")
        if saved_parallel != self.parallel:
            raise ConfigValueError(f"{self.path} was written with train.parallel="
                                   f"{saved_parallel}; resume with that setting (now "
                                   f"{self.parallel}), or delete it to start over")
        self._load(saved)
        self.scheduler.load_state_dict(saved["scheduler"])
        rank = min(self.dist.rank, len(saved["rng"]) - 1)
        restore_rng(saved["rng"][rank])
        if "windows" in saved:  # checkpoints written before the window was kept start afresh
            window.load_state_dict(saved["windows"][rank])
        log.info("train: resuming from %s at step %d (epoch %d, row %d of the epoch)",
                 self.path, state.step, state.epoch, state.step_in_epoch * self.dist.world)
        return state

    def _save(self, common: dict[str, Any]) -> None:
        raise NotImplementedError

    def _load(self, saved: dict[str, Any]) -> None:
        raise NotImplementedError


class DDPCheckpointer(Checkpointer):
    parallel = "ddp"

    def _save(self, common: dict[str, Any]) -> None:
        if not self.dist.is_main:
            return
        model = {k: v.cpu() for k, v in self.drafter.state_dict().items() if k not in SKIPPED}
        saved = {**common, "model": model, "optimizer": self.optimizer.state_dict()}
        with atomic_path(self.path, tensor_bytes(saved)) as tmp:
            torch.save(saved, tmp)

    def _load(self, saved: dict[str, Any]) -> None:
        self.drafter.load_state_dict(saved["model"], strict=False)
        self.optimizer.load_state_dict(saved["optimizer"])


class FSDPCheckpointer(Checkpointer):
    parallel = "fsdp"

    def _save(self, common: dict[str, Any]) -> None:
        from draftsmith.train import fsdp

        step = common["position"]["step"]
        names = [f"rank{r}-step{step}.pt" for r in range(self.dist.world)]
        shard = {"model": fsdp.local_state(self.drafter, skip=SKIPPED),
                 "optimizer": fsdp.local_optimizer_state(self.optimizer.optimizer)}
        with atomic_path(self.path.parent / names[self.dist.rank], tensor_bytes(shard)) as tmp:
            torch.save(shard, tmp)
        self.dist.barrier()
        if not self.dist.is_main:
            return
        with atomic_path(self.path, tensor_bytes(common)) as tmp:
            torch.save({**common, "shards": names}, tmp)
        for old in self.path.parent.glob("rank*-step*.pt"):
            if old.name not in names:
                old.unlink(missing_ok=True)

    def _load(self, saved: dict[str, Any]) -> None:
        from draftsmith.train import fsdp

        shard_path = self.path.parent / saved["shards"][self.dist.rank]
        if not shard_path.is_file():
            raise CheckpointError(f"{self.path} names {shard_path}, which is missing; delete "
                                  f"{self.path.parent} to start over")
        shard = torch.load(shard_path, map_location="cpu", weights_only=False)
        fsdp.load_local_state(self.drafter, shard["model"])
        fsdp.load_local_optimizer_state(self.optimizer.optimizer, shard["optimizer"])


def checkpointer_for(parallel: str, out: Path, dist: Dist, drafter: Drafter,
                     optimizer: MasterWeightAdamW, scheduler: Any) -> Checkpointer:
    cls = FSDPCheckpointer if parallel == "fsdp" else DDPCheckpointer
    return cls(out, dist, drafter, optimizer, scheduler)
