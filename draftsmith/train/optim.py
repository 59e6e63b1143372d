"""AdamW with float32 master weights for low-precision parameters, and the LR schedule.

The drafter's parameters live in bf16 on the GPU (half the memory and bandwidth of fp32 in
every matmul); AdamW runs on float32 masters and writes them back in bf16, so small updates
that bf16 would round away accumulate in the masters. With float32 parameters the masters are
the parameters themselves.

On CUDA, with low-precision parameters, the step is one pass over memory (`adamw_on_masters`,
compiled): per parameter it reads the bf16 gradient, master, exp_avg and exp_avg_sq once and
writes master, both moments and the bf16 parameter once. Elsewhere it is torch's: float32
copies of the gradients, clip_grad_norm_, AdamW, a copy back. For an 8B-shaped drafter on an
H200 the one-pass step takes 3.0 ms against 5.1 ms alone, with 0.55 GiB of temporaries against
1.64 (benchmarks/train_kernels.py), and the whole training step gains 1.8-2.5% (same process,
interleaved: benchmarks/results/train_attempts_h200/adamw_single_pass_ab.jsonl). The learning
rate is a kept device tensor, filled each step: building it from a Python float would be a
host-to-device copy that waits for the GPU, and the GPU would then idle while the host builds
the next row (a first version did that and lost 3-5% end to end). Both paths keep torch's
AdamW state layout, so checkpoints load in either.
"""

from __future__ import annotations

import math

import torch

from draftsmith.compiling import compiled_once


def adamw_on_masters(params: list[torch.Tensor], grads: list[torch.Tensor],
                     masters: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                     exp_avg_sqs: list[torch.Tensor], step: torch.Tensor, lr: torch.Tensor,
                     max_norm: float, beta1: float, beta2: float, eps: float,
                     weight_decay: float) -> torch.Tensor:
    """Clip the gradients to max_norm (global norm, float32), then torch's AdamW update of the
    float32 masters, written back to the low-precision params. step: the step number after
    this update (0-d float32), lr: 0-d float32 (tensors, so a compiled form does not recompile
    as they change). Returns the norm before clipping."""
    norm = torch.stack([g.float().pow(2).sum() for g in grads]).sum().sqrt()  # []
    clip = (max_norm / (norm + 1e-6)).clamp(max=1.0)  # [] as clip_grad_norm_ scales
    step_size = lr / (1 - beta1 ** step)  # []
    bias2_sqrt = (1 - beta2 ** step).sqrt()  # []
    for param, grad, master, exp_avg, exp_avg_sq in zip(params, grads, masters, exp_avgs,
                                                        exp_avg_sqs, strict=True):
        g = grad.float() * clip  # [*] float32
        master.mul_(1 - lr * weight_decay)
        exp_avg.lerp_(g, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        master.sub_(step_size * exp_avg / (exp_avg_sq.sqrt() / bias2_sqrt + eps))
        param.copy_(master)
    return norm


class MasterWeightAdamW:
    """single_pass: run `adamw_on_masters` (compiled on CUDA, eager elsewhere) instead of torch's
    AdamW, for low-precision parameters; default: on CUDA."""

    def __init__(self, params: list[torch.nn.Parameter], lr: float, weight_decay: float,
                 betas: tuple[float, float] = (0.9, 0.999), single_pass: bool | None = None):
        self.params = list(params)
        self.low_precision = any(p.dtype != torch.float32 for p in self.params)
        if self.low_precision:
            self.master = [p.detach().float().clone() for p in self.params]  # fp32 copies
        else:
            self.master = self.params
        on_cuda = bool(self.master) and self.master[0].is_cuda
        self.optimizer = torch.optim.AdamW(self.master, lr=lr, weight_decay=weight_decay,
                                           betas=betas, fused=on_cuda or None)
        if single_pass is None:
            single_pass = on_cuda
        self.single_pass = single_pass and self.low_precision
        self._compiled = on_cuda
        # The learning rate as a device tensor, filled each step: a tensor built from a Python
        # float would be a host-to-device copy, which waits for the GPU.
        self._lr = torch.zeros((), dtype=torch.float32,
                               device=self.master[0].device if self.master else "cpu")

    def step(self, grad_clip: float) -> torch.Tensor:
        """Clip to grad_clip (global norm, on the float32 gradients), step, zero the grads.
        Returns the norm before clipping."""
        for p in self.params:
            if p.grad is None:  # a rank without a row this step still takes part
                p.grad = torch.zeros_like(p)
        if self.single_pass:
            norm = self._single_pass_step(grad_clip)
            # A step of torch's optimizer state all the same: the learning-rate scheduler
            # learns of steps from the flag torch's own step() sets, and without it warns on
            # every run that the schedule's first value was skipped (it was not).
            self.optimizer._opt_called = True
        else:
            norm = self._torch_step(grad_clip)
        for p in self.params:
            p.grad = None
        return norm

    def _torch_step(self, grad_clip: float) -> torch.Tensor:
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
        return norm

    def _single_pass_step(self, grad_clip: float) -> torch.Tensor:
        group = self.optimizer.param_groups[0]
        states = [self._state_of(master) for master in self.master]
        steps = [state["step"] for state in states]
        torch._foreach_add_(steps, 1.0)
        lr = self._lr.fill_(float(group["lr"]))
        beta1, beta2 = group["betas"]
        update = compiled_once(adamw_on_masters, fullgraph=True, dynamic=False) \
            if self._compiled else adamw_on_masters
        with torch.no_grad():
            return update([p.data for p in self.params], [p.grad for p in self.params],
                          self.master, [s["exp_avg"] for s in states],
                          [s["exp_avg_sq"] for s in states], steps[0], lr, float(grad_clip),
                          float(beta1), float(beta2), float(group["eps"]),
                          float(group["weight_decay"]))

    def _state_of(self, master: torch.Tensor) -> dict:
        """torch's AdamW state for a master (created as torch's fused AdamW creates it), so a
        checkpoint written by either path loads in the other."""
        state = self.optimizer.state[master]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=master.device)
            state["exp_avg"] = torch.zeros_like(master, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(master, memory_format=torch.preserve_format)
        return state

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
