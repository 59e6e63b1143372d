"""Capture the aux hidden states and the final (normed) hidden state of a transformers target.

Canonical convention (docs/concepts.md, "Aux layer ids"): aux id i is the OUTPUT of decoder
layer i, which transformers returns as hidden_states[i + 1]. Forward hooks on exactly those
layers (draftsmith/model/aux_hooks.py) capture them, so the other L+1 hidden states are never
materialised.

The target's greedy next token at each position (the argmax of lm_head(final) over the full
vocab) is taken here too, a chunk of positions at a time: training needs it for every position
of every epoch ("target argmax in the draft vocab" masks the loss), and computing it once here
spares the trainer a full-vocab matmul per row (10% of a TTT-3 step of an 8B-shaped drafter).
"""

from __future__ import annotations

import torch

from draftsmith.model.aux_hooks import AuxLayerHooks, decoder_of


class HiddenStateCapture:
    def __init__(self, model, aux_layer_ids: list[int]):
        self.model, self.aux_layer_ids = model, aux_layer_ids
        self.decoder = decoder_of(model)

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None):
        """input_ids [B, T] -> aux [B, T, K*H], final [B, T, H].

        A right-padded batch needs no attention_mask: under causal attention a real token only
        sees the tokens before it, all real, so its states equal an unpadded run's, and the
        padding rows are dropped by the caller. Without a mask SDPA takes its fused causal
        (flash) kernel instead of a masked kernel that computes every (query, key) pair."""
        with AuxLayerHooks(self.decoder, self.aux_layer_ids) as hooks:
            out = self.decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
            final = out.last_hidden_state  # [B, T, H], after model.norm
            aux = hooks.take(final.device)  # [B, T, K*H], gathered where final is
        return aux, final

    @torch.inference_mode()
    def real_tokens(self, input_ids: torch.Tensor, flat: torch.Tensor):
        """A right-padded batch -> the states of its real tokens, one batch's worth of kernels
        however many samples it holds: input_ids [B, T] on the model's device, flat [N] the
        real tokens' indices into B * T (`real_token_index`) -> aux [N, K*H], final [N, H],
        the target's argmax [N] int32. Gathering by index avoids the host sync of a boolean
        mask."""
        aux, final = self(input_ids)  # [B, T, K*H], [B, T, H]
        flat = flat.to(aux.device, non_blocking=True)  # the last GPU under a device_map
        aux = aux.reshape(-1, aux.shape[-1]).index_select(0, flat)  # [N, K*H]
        final = final.reshape(-1, final.shape[-1]).index_select(0, flat)  # [N, H]
        return aux, final, self.target_argmax(final)  # [N, K*H], [N, H], [N]

    @torch.inference_mode()
    def target_argmax(self, final: torch.Tensor, chunk_tokens: int = 4096) -> torch.Tensor:
        """final [N, H] (after the final norm, as __call__ returns it) -> the target's argmax
        token at each position [N] int32; logits exist for chunk_tokens positions at a time."""
        head = self.model.get_output_embeddings()
        parts = [head(part.to(head.weight.device)).argmax(-1).to(torch.int32)  # [c]
                 for part in final.split(chunk_tokens)]
        return torch.cat(parts).to(final.device)  # [N]


def real_token_index(lengths: list[int], longest: int) -> torch.Tensor:
    """The flat indices [N] of the real tokens of right-padded rows of these lengths, row by
    row, into a [B, longest] batch."""
    return torch.cat([torch.arange(n) + i * longest for i, n in enumerate(lengths)])  # [N]
