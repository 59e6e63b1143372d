"""The two parallel modes of the trainer, each in one class: where the drafter's weights live,
how a step's gradients are combined, and how the whole drafter is read back.

- `DDP` (`train.parallel: ddp`): every rank holds the whole drafter in the training dtype;
  gradients are all-reduced after each backward pass and divided by the rows the step trained
  (what DDP does, done by hand because one optimiser step is one packed row per rank, and a
  rank without a row in an epoch's last step must still take part with zero gradients).
- `FSDP` (`train.parallel: fsdp`): the drafter is sharded (`draftsmith/train/fsdp.py`); the
  float32 shards are the master weights, all-gathered in the compute dtype.

Their checkpoints are written by `draftsmith/train/checkpoint.py`.
"""

from __future__ import annotations

import torch

from draftsmith.distributed import Dist
from draftsmith.errors import ConfigValueError
from draftsmith.model.kinds import Drafter


class DDP:
    name = "ddp"
    sharded = False

    def __init__(self, dist: Dist):
        self.dist = dist

    def place(self, drafter: Drafter, dtype: torch.dtype, device: torch.device) -> None:
        with torch.no_grad():  # parameters only: RoPE's inv_freq buffer stays float32
            for p in drafter.parameters():
                p.data = p.data.to(dtype)
        drafter.to(device)

    def sync_gradients(self, params: list[torch.nn.Parameter], rows_in_step: int) -> None:
        """Sum every rank's gradients and divide by the rows this step trained on, so the step
        is the mean over rows whatever the number of ranks."""
        if self.dist.world == 1:
            return
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in params]
        flat = torch.cat([g.flatten().float() for g in grads])  # [N] one all-reduce
        self.dist.all_reduce_(flat)
        flat /= rows_in_step
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()

    def weight_sum(self, params: list[torch.nn.Parameter]) -> float:
        """This rank's copy, summed (equal on every rank when gradients were averaged right)."""
        return sum(p.detach().double().sum().item() for p in params)

    def whole_state(self, drafter: Drafter, dtype: torch.dtype
                    ) -> dict[str, torch.Tensor] | None:
        """The tensors to save as the best drafter; None: the drafter's own state_dict."""
        return None

    def reset_after_failure(self, drafter: Drafter) -> None:
        pass


class FSDP(DDP):
    name = "fsdp"
    sharded = True

    def place(self, drafter: Drafter, dtype: torch.dtype, device: torch.device) -> None:
        from draftsmith.train import fsdp

        fsdp.shard_drafter(drafter, dtype, self.dist.device_mesh(device.type))  # float32 shards

    def sync_gradients(self, params: list[torch.nn.Parameter], rows_in_step: int) -> None:
        from draftsmith.train import fsdp

        fsdp.rescale_gradients(params, self.dist.world, rows_in_step)  # reduce-scattered

    def weight_sum(self, params: list[torch.nn.Parameter]) -> float:
        """The sum over the whole (sharded) weights, the same figure on every rank."""
        from draftsmith.train.fsdp import local

        mine = sum(local(p).detach().double().sum().item() for p in params)
        return self.dist.sum_tensor(torch.tensor([mine], dtype=torch.float64)).item()  # [1]

    def whole_state(self, drafter: Drafter, dtype: torch.dtype
                    ) -> dict[str, torch.Tensor] | None:
        """Gathered whole: a collective every rank joins."""
        from draftsmith.export.native import NOT_STORED
        from draftsmith.train.fsdp import full_state

        return full_state(drafter, dtype, skip=NOT_STORED)

    def reset_after_failure(self, drafter: Drafter) -> None:
        from draftsmith.train import fsdp

        fsdp.reset_after_failure(drafter)


def parallel_mode(name: str, dist: Dist) -> DDP:
    if name == "fsdp":
        if not dist.grouped:
            raise ConfigValueError("train.parallel=fsdp shards the drafter over a process "
                                   "group: run it through run_train (which starts torchrun), "
                                   "or set train.parallel=ddp")
        return FSDP(dist)
    return DDP(dist)
