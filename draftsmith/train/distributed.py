"""Data parallelism for the trainer: one process per GPU (or CPU process with gloo) under
torchrun. DDP (`train.parallel: ddp`): gradients averaged with all-reduce after each backward
pass (what DDP does, done by hand because one optimiser step here is one packed row per rank,
and a rank without a row in an epoch's last step must still take part with zero gradients).
FSDP (`train.parallel: fsdp`) shards the drafter instead: `draftsmith/train/fsdp.py`."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as torch_dist


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    grouped: bool = False  # a process group exists (always under FSDP, even for one process)

    @classmethod
    def single(cls) -> Dist:
        return cls()

    @classmethod
    def from_env(cls, backend: str, always: bool = False) -> Dist:
        """Join the group torchrun set up (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR...); a
        single process joins none unless `always` (FSDP shards over a group of one, too)."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world == 1 and not always:
            return cls.single()
        torch_dist.init_process_group(backend=backend)
        return cls(torch_dist.get_rank(), torch_dist.get_world_size(),
                   int(os.environ.get("LOCAL_RANK", "0")), grouped=True)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def device(self, configured: str) -> torch.device:
        """cuda -> this rank's GPU (cuda:LOCAL_RANK) when several processes share a host."""
        device = torch.device(configured)
        if device.type == "cuda" and self.grouped:
            if self.world > 1 or device.index is None:
                device = torch.device("cuda", self.local_rank)
            torch.cuda.set_device(device)  # NCCL and FSDP's mesh use the current device
        return device

    def average_gradients(self, params: list[torch.nn.Parameter], rows_in_step: int) -> None:
        """Sum every rank's gradients and divide by the rows this step trained on, so the step
        is the mean over rows whatever the number of ranks."""
        if self.world == 1:
            return
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in params]
        flat = torch.cat([g.flatten().float() for g in grads])  # [N] one all-reduce
        torch_dist.all_reduce(flat)
        flat /= rows_in_step
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()

    def sum_tensor(self, t: torch.Tensor) -> torch.Tensor:
        if self.world == 1:
            return t
        device = "cuda" if torch_dist.get_backend() == "nccl" else "cpu"
        out = t.to(device).clone()
        torch_dist.all_reduce(out)
        return out.cpu()

    def gather_objects(self, obj: Any) -> list[Any]:
        if self.world == 1:
            return [obj]
        out: list[Any] = [None] * self.world
        torch_dist.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        if self.world > 1:
            torch_dist.barrier()

    def close(self) -> None:
        if self.grouped and torch_dist.is_initialized():
            torch_dist.destroy_process_group()
