"""What every drafter kind's module shares: the target's embedding and the draft vocab map
(`TargetTiedDrafter`), and flex_attention, compiled once on CUDA."""

from __future__ import annotations

import math

import torch
from torch import nn

from draftsmith.compiling import compiled_once

try:  # flex_attention exists from torch 2.5; the SDPA path needs nothing of it
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention
except ImportError:  # pragma: no cover - old torch
    BlockMask = type("BlockMask", (), {})
    create_block_mask = flex_attention = None


def flex_attention_fn():
    """flex_attention, compiled on CUDA (eager flex is a dense reference implementation, far
    slower than SDPA). The trainer falls back to the SDPA path, with a warning, when
    compiling fails (the seeds hit a Triton shared-memory limit on Blackwell)."""
    if torch.cuda.is_available():
        return compiled_once(flex_attention, dynamic=False)
    return flex_attention


class TargetTiedDrafter(nn.Module):
    """What every drafter kind (draftsmith/model/registry.py) shares: the target's embedding,
    copied in before use, and the draft vocab map (d2t: offsets, target id = draft id +
    d2t; t2d: whether a target id is in the draft vocab). A subclass makes embed_tokens,
    lm_head and its layers, calls register_vocab_map, then reset_parameters."""

    def register_vocab_map(self, cfg) -> None:
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))  # [D]
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))  # [V]

    def reset_parameters(self) -> None:
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=1 / math.sqrt(module.in_features))
        # Copied from the target before use: NaN makes a forgotten copy fail loudly.
        nn.init.constant_(self.embed_tokens.weight, float("nan"))
        with torch.no_grad():
            self.d2t.fill_(0)
            self.t2d.fill_(False)

    def load_target_parts(self, embed: torch.Tensor, d2t: torch.Tensor, t2d: torch.Tensor,
                          target_head: torch.Tensor | None = None) -> None:
        """Copy the target's embedding and the vocab map; optionally start lm_head from the
        target head's rows for the draft vocab."""
        with torch.no_grad():
            self.embed_tokens.weight.copy_(embed)
            self.d2t.copy_(d2t)
            self.t2d.copy_(t2d)
            if target_head is not None:
                self.lm_head.weight.copy_(target_head[self.draft_to_target_ids()])

    def in_forward(self, fn, *args, **kwargs):
        """fn(self, *args, **kwargs), run as a forward pass of this module. Under FSDP2 a
        parameter is whole only inside a forward of the module that owns it, and the trainer's
        row (the kind's forward, then the loss fused with lm_head, which reads lm_head.weight
        itself) is more than one forward: the trainer registers this method as a forward
        (`register_fsdp_forward_method`), so the whole row runs with whole parameters.
        Without FSDP it is a plain call."""
        return fn(self, *args, **kwargs)

    def draft_to_target_ids(self) -> torch.Tensor:
        return self.d2t + torch.arange(self.d2t.numel(), device=self.d2t.device)  # [D]
