"""Forward hooks on a transformers target's aux layers: their outputs after a forward pass.

Aux id i is the OUTPUT of decoder layer i (transformers' hidden_states[i + 1]); hooking exactly
those layers keeps the other hidden states from being materialised.
"""

from __future__ import annotations

import weakref

import torch

# decoder -> aux layer ids -> the hooks that holders share (AuxLayerHooks.shared)
_SHARED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def decoder_of(model):
    """The decoder stack (embeddings, layers, final norm) of a *ForCausalLM model."""
    base = getattr(model, "model", None)
    if base is None or not hasattr(base, "layers") or not hasattr(base, "norm"):
        raise TypeError(f"{type(model).__name__}: expected a decoder with .model.layers and "
                        ".model.norm (Llama-style); this architecture is not supported yet")
    return base


class AuxLayerHooks:
    """Forward hooks on exactly the aux layers of a decoder: after a forward pass, `take()`
    returns their outputs side by side. The extract capture puts them on for one call; the
    embedded speculative engine's runners share them (`shared`) for the life of each."""

    def __init__(self, decoder, aux_layer_ids: list[int]):
        self.aux_layer_ids = list(aux_layer_ids)
        self._captured: dict[int, torch.Tensor] = {}
        self._handles = [decoder.layers[i].register_forward_hook(self._hook(i))
                         for i in self.aux_layer_ids]
        self._holders = 1

    @classmethod
    def shared(cls, decoder, aux_layer_ids: list[int]) -> AuxLayerHooks:
        """The hooks that another holder already keeps on these layers of this decoder, or
        new ones; each holder's remove() lets go of them, the last takes them off. A
        benchmark's sweep runs an engine per point on one target while the deployed engine
        keeps its runner: hooks of their own would record every forward twice, into a dict
        that only one of them empties, and torch.compile, which traces every hook into the
        graph and guards on that dict, would compile the other's steps again."""
        held = _SHARED.setdefault(decoder, {})
        key = tuple(aux_layer_ids)
        hooks = held.get(key)
        if hooks is None or not hooks._handles:
            hooks = held[key] = cls(decoder, aux_layer_ids)
        else:
            hooks._holders += 1
        return hooks

    def _hook(self, layer_id: int):
        def hook(_module, _inputs, output):
            self._captured[layer_id] = output[0] if isinstance(output, tuple) else output
        return hook

    def take(self, device: torch.device | None = None) -> torch.Tensor:
        """The last forward's aux outputs [B, T, K*H] (on `device`: with device_map the layers
        live on several GPUs)."""
        aux = torch.cat([self._captured[i].to(device) if device is not None else self._captured[i]
                         for i in self.aux_layer_ids], dim=-1)  # [B, T, K*H]
        self._captured.clear()
        return aux

    def remove(self) -> None:
        self._holders -= 1
        if self._holders > 0:  # shared: another holder still reads them
            return
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._captured.clear()

    def __enter__(self) -> AuxLayerHooks:
        return self

    def __exit__(self, *_exc) -> None:
        self.remove()
