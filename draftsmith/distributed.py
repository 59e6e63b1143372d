"""The process group a stage runs in under torchrun, joined in one place (extract and train).

torchrun sets RANK, WORLD_SIZE, LOCAL_RANK and MASTER_ADDR/PORT; `Dist.from_env` joins the
group they describe (a single process joins none unless asked: FSDP shards over a group of
one). The collectives the stages use are wrapped here so that a world of one needs no group.
"""

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
        """Join the group torchrun set up; a single process joins none unless `always`."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world == 1 and not always:
            return cls.single()
        if not torch_dist.is_initialized():
            torch_dist.init_process_group(backend=backend)
        return cls(torch_dist.get_rank(), torch_dist.get_world_size(),
                   int(os.environ.get("LOCAL_RANK", "0")), grouped=True)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def device_name(self, configured: str) -> str:
        """This rank's device, with an explicit index for CUDA: cuda:LOCAL_RANK when several
        processes share a host, else the configured GPU (cuda:0 for a bare "cuda", which
        torch.cuda.set_device refuses)."""
        if not configured.startswith("cuda"):
            return configured
        if self.world > 1:
            return f"cuda:{self.local_rank}"
        return "cuda:0" if configured == "cuda" else configured

    def device(self, configured: str, set_current: bool = True) -> torch.device:
        """device_name as a torch.device; set_current: make it the current CUDA device (NCCL,
        FSDP's mesh and the compiled kernels use it)."""
        device = torch.device(self.device_name(configured))
        if device.type == "cuda" and set_current:
            torch.cuda.set_device(device)
        return device

    def sum_tensor(self, t: torch.Tensor) -> torch.Tensor:
        if self.world == 1:
            return t
        device = "cuda" if torch_dist.get_backend() == "nccl" else "cpu"
        out = t.to(device).clone()
        torch_dist.all_reduce(out)
        return out.cpu()

    def all_reduce_(self, t: torch.Tensor) -> None:
        """Sum t across the ranks, in place (a world of one: nothing to do)."""
        if self.world > 1:
            torch_dist.all_reduce(t)

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
