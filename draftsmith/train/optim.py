"""AdamW with float32 master weights for low-precision parameters, and the LR schedule.

The drafter's parameters live in bf16 on the GPU (half the memory and bandwidth of fp32 in
every matmul); each optimiser step copies their gradients into float32 masters, clips, runs
AdamW on the masters (fused on CUDA) and writes the masters back in bf16. Small updates that
bf16 would round away accumulate in the masters. With float32 parameters the masters are the
parameters themselves.
"""

from __future__ import annotations

import math

import torch


class MasterWeightAdamW:
    def __init__(self, params: list[torch.nn.Parameter], lr: float, weight_decay: float,
                 betas: tuple[float, float] = (0.9, 0.999)):
        self.params = list(params)
        self.low_precision = any(p.dtype != torch.float32 for p in self.params)
        if self.low_precision:
            self.master = [p.detach().float().clone() for p in self.params]  # fp32 copies
        else:
            self.master = self.params
        fused = bool(self.master) and self.master[0].is_cuda
        self.optimizer = torch.optim.AdamW(self.master, lr=lr, weight_decay=weight_decay,
                                           betas=betas, fused=fused or None)

    def step(self, grad_clip: float) -> torch.Tensor:
        """Clip to grad_clip (global norm, on the float32 gradients), step, zero the grads.
        Returns the norm before clipping."""
        for p in self.params:
            if p.grad is None:  # a rank without a row this step still takes part
                p.grad = torch.zeros_like(p)
        if self.low_precision:
            for master, p in zip(self.master, self.params, strict=True):
                master.grad = p.grad.float()
        norm = torch.nn.utils.clip_grad_norm_(self.master, grad_clip)
        self.optimizer.step()
        if self.low_precision:
            with torch.no_grad():
                torch._foreach_copy_([p.data for p in self.params], self.master)
            for master in self.master:
                master.grad = None
        for p in self.params:
            p.grad = None
        return norm

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(),
                "master": [m.detach().cpu() for m in self.master] if self.low_precision else None}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        if self.low_precision and state["master"] is not None:
            with torch.no_grad():
                for master, saved, p in zip(self.master, state["master"], self.params,
                                            strict=True):
                    master.copy_(saved)
                    p.copy_(saved)


def lr_factor(warmup_ratio: float, scheduler: str, total_steps: int):
    """Linear warmup over warmup_ratio of the steps, then cosine to 0 (or constant)."""
    warmup = int(warmup_ratio * total_steps)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        if scheduler == "constant":
            return 1.0
        progress = (step - warmup) / max(1, total_steps - warmup)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor
