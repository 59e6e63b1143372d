"""Fully sharded data parallelism (`train.parallel: fsdp`, FSDP2's `fully_shard`) for drafters
too big to keep whole on every GPU.

What is sharded: every parameter, its gradient and its AdamW state, 1/W per rank, in two units:
the decoder layer (`midlayer`), then the root drafter with the rest (fc, norm, lm_head and the
frozen target embedding, which alone is 2.3 GB in bf16 for a Kimi-sized target: 163,840 x
7168). Buffers (d2t, t2d, RoPE) are small and stay whole.

Mixed precision the FSDP way: the sharded parameters stay float32 and are the master weights
(`MasterWeightAdamW` sees float32 parameters and keeps no copies); they are all-gathered in
bf16 for compute when `train.dtype` is bfloat16, and gradients are reduce-scattered in float32.

A parameter is whole only inside a forward of the module that owns it, so the trainer's row
(TTT forward and the loss fused with lm_head) runs through `TargetTiedDrafter.in_forward`,
registered here as a forward method, and so are the decoder layer's `embedding_qkv` and
`forward_projected`, which the row calls instead of its forward. Every rank must join every
all-gather and reduce-scatter: a rank without a row runs an all-padding row (zero loss, zero
gradients), in training and in validation alike.

Checkpoints: each rank saves and loads its own shards (plain tensors); the best drafter is
gathered whole (a collective every rank joins) and written by rank 0.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from draftsmith.model.kinds import Drafter

FORWARD_METHOD = "in_forward"
# The decoder layer's methods that the TTT row calls in place of its forward (the embedding
# half of q/k/v once a row, then each step): its parameters must be whole in them too.
LAYER_FORWARD_METHODS = ("embedding_qkv", "forward_projected",  # EAGLE-3's
                         "context_kv")  # DFlash's: the context's keys and values per layer


def shard_drafter(drafter: Drafter, compute_dtype: torch.dtype, mesh: Any) -> None:
    """fully_shard the drafter in place over a 1-D device mesh (`Dist.device_mesh`): float32
    shards, `compute_dtype` for the all-gathered parameters, float32 reductions."""
    from torch.distributed.fsdp import (
        MixedPrecisionPolicy,
        fully_shard,
        register_fsdp_forward_method,
    )

    with torch.no_grad():  # float32 shards are the master weights
        for p in drafter.parameters():
            p.data = p.data.float()
    # Inputs are not cast: the row's code casts what it needs to the parameters' dtype.
    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32,
                                  cast_forward_inputs=False)
    # EAGLE-3's one layer (midlayer), or each of DFlash's layers, is its own unit.
    layers = [drafter.midlayer] if hasattr(drafter, "midlayer") else list(drafter.layers)
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(drafter, mesh=mesh, mp_policy=policy)
    register_fsdp_forward_method(drafter, FORWARD_METHOD)
    for layer in layers:
        for method in LAYER_FORWARD_METHODS:
            if hasattr(layer, method):
                register_fsdp_forward_method(layer, method)
    # The decoder layer returns its value tensor as a view (transpose); the trainer only
    # concatenates it, never writes into it, which is the case this warning is about.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")


def _is_dtensor(t: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a sharded tensor (the tensor itself otherwise)."""
    return t.to_local() if _is_dtensor(t) else t


def rescale_gradients(params: list[nn.Parameter], world: int, rows_in_step: int) -> None:
    """The reduce-scatter averaged the gradients over the `world` ranks; a step is the mean
    over the rows it trained (fewer than the ranks in an epoch's last step, where the others
    ran padding with zero gradients): times world / rows_in_step, as the DDP path divides."""
    if rows_in_step == world:
        return
    grads = [local(p.grad) for p in params if p.grad is not None]
    torch._foreach_mul_(grads, world / rows_in_step)


def local_state(drafter: nn.Module, skip: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """This rank's shards of the model state (plain CPU tensors), for its resume file."""
    return {k: local(v).detach().cpu().clone() for k, v in drafter.state_dict().items()
            if k not in skip}  # each [rows of this rank's shard, ...]


def load_local_state(drafter: nn.Module, saved: dict[str, torch.Tensor]) -> None:
    """Copy shards written by `local_state` on this rank (same world size) back in."""
    current = drafter.state_dict()
    unknown = sorted(set(saved) - set(current))
    if unknown:
        raise ValueError(f"resume shard holds tensors this drafter does not have: {unknown}")
    with torch.no_grad():
        for name, tensor in saved.items():
            target = local(current[name])
            if target.shape != tensor.shape:
                raise ValueError(f"resume shard of {name} is {tuple(tensor.shape)}, this rank's "
                                 f"shard is {tuple(target.shape)}: written by another world size")
            target.copy_(tensor)


def local_optimizer_state(optimizer: torch.optim.Optimizer) -> dict:
    """optimizer.state_dict() with each sharded state tensor replaced by this rank's shard."""
    state = optimizer.state_dict()
    return {"param_groups": state["param_groups"],
            "state": {i: {k: local(v).detach().cpu().clone() if isinstance(v, torch.Tensor)
                          else v for k, v in s.items()}  # exp_avg(_sq): the shard's shape
                      for i, s in state["state"].items()}}


def load_local_optimizer_state(optimizer: torch.optim.Optimizer, saved: dict) -> None:
    """Load what `local_optimizer_state` wrote: each shard is made a DTensor again, laid out
    as its parameter (AdamW's exp_avg and exp_avg_sq have their parameter's shape)."""
    from torch.distributed.tensor import DTensor

    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = {}
    for i, entries in saved["state"].items():
        p = params[int(i)]
        state[i] = {}
        for k, v in entries.items():
            if _is_dtensor(p) and isinstance(v, torch.Tensor) and v.shape == p.to_local().shape \
                    and v.dim() > 0:
                v = DTensor.from_local(v.to(p.device), p.device_mesh, p.placements,
                                       run_check=False, shape=p.shape,
                                       stride=p.stride())  # p's global shape, sharded as p
            state[i][k] = v
    optimizer.load_state_dict({"param_groups": saved["param_groups"], "state": state})


def full_state(drafter: nn.Module, dtype: torch.dtype, skip: tuple[str, ...] = ()
               ) -> dict[str, torch.Tensor]:
    """The whole model state on the CPU, floating tensors in `dtype`. Every rank must call it
    (each sharded tensor is all-gathered, one at a time, so a GPU holds one whole tensor)."""
    out = {}
    for name, tensor in drafter.state_dict().items():
        if name in skip:
            continue
        whole = tensor.full_tensor() if _is_dtensor(tensor) else tensor  # the global shape
        out[name] = (whole.to(dtype) if whole.is_floating_point() else whole).cpu()  # same
    return out


def reset_after_failure(drafter: nn.Module) -> None:
    """After a forward or backward raised (a compiled path that failed), FSDP's per-iteration
    state must be reset before the trainer retries on the fallback path."""
    reset = getattr(drafter, "reset_iter_state", None)
    if reset is not None:
        reset()
