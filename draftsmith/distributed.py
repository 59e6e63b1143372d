"""The process group a stage runs in under torchrun, joined in one place (extract and train).

torchrun sets RANK, WORLD_SIZE, LOCAL_RANK and MASTER_ADDR/PORT; `Dist.from_env` joins the
group they describe (a single process joins none unless asked: FSDP shards over a group of
one). The collectives the stages use are wrapped here so that a world of one needs no group.

Leaving the group is ordered too (`Dist.close`, docs/reliability-training.md): a gloo group
runs its collectives on worker threads, which must be joined before Python shuts down. A
worker thread that asks for the GIL once Python is finalizing (to drop a tensor of its last
collective) is ended by CPython with pthread_exit, whose unwinding through a C++ destructor
aborts the process: "terminate called without an active exception". destroy_process_group
joins the threads only when it drops the last reference to the group; under FSDP torch keeps
two more (see `close`).
"""

from __future__ import annotations

import gc
import logging
import os
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as torch_dist

log = logging.getLogger(__name__)


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    grouped: bool = False  # a process group exists (always under FSDP, even for one process)
    meshes: list[Any] = field(default_factory=list, repr=False)  # made by device_mesh

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
            # Its functions take group.WORLD as a default argument, evaluated when the module
            # is first imported (FSDP imports it): after init_process_group they would hold
            # the group for good. Imported first, they hold None.
            import torch.distributed.nn.functional  # noqa: F401

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

    def device_mesh(self, device_type: str) -> Any:
        """A 1-D device mesh over the whole group (what FSDP shards over), let go of in
        `close`."""
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device_type, (self.world,))
        self.meshes.append(mesh)
        return mesh

    def close(self, failed: bool = False) -> None:
        """Leave the group. After a barrier every rank passed (nothing is left in flight), the
        group is freed here and its gloo worker threads are joined while Python still runs:
        - each mesh made by `device_mesh` lets go of the group (DTensor's caches keep the
          mesh, and with it the group, for the life of the process);
        - the garbage the run left is collected (the FSDP modules, in reference cycles, hold
          the group in their state);
        - destroy_process_group then drops the last reference, and the group's destructor
          drains its queue and joins its threads, with the GIL released for them.
        failed: a rank that raised leaves without waiting for threads that may be blocked on
        a peer that is gone (torchrun stops the job)."""
        if not (self.grouped and torch_dist.is_initialized()):
            return
        if failed:
            torch_dist.destroy_process_group()
            return
        for mesh in self.meshes:
            registry = getattr(mesh, "_pg_registry", None)  # torch 2.13's name for it
            if registry is not None:
                registry.clear()
        self.meshes.clear()
        gc.collect()
        gloo = torch_dist.get_backend() == "gloo"
        group = weakref.ref(torch_dist.group.WORLD)
        torch_dist.destroy_process_group()
        if gloo and group() is not None:
            log.warning("the gloo process group outlived destroy_process_group (something "
                        "still references it): its worker threads were not joined and may "
                        "abort this process as Python shuts down")
