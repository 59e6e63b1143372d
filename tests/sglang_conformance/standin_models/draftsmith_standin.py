"""Built-in model classes for SGLang's registry on a CPU, where none of SGLang's own import
(they need its CUDA kernels). The conformance probe adds this directory to
`sglang.srt.models.__path__`, so SGLang's `import_model_classes("sglang.srt.models")` finds
these classes the way it finds its own: the registry code under test is SGLang's.

Each class keeps what draftsmith's capture relies on, read from SGLang 0.5.23: a decoder at
`.model` with `.layers` and `layers_to_capture` (the INPUT of each listed layer is captured), a
`logits_processor` called with (input_ids, hidden_states, lm_head, forward_batch, aux). The
DeepSeek model collects aux states with SGLang's own AuxHiddenStatePacker (one [N, K*H]
tensor); Llama passes a list; Kimi-K2.5 wraps the DeepSeek model and calls it with
input_ids=None, as SGLang's mm_utils does.
"""

from __future__ import annotations

import torch
from torch import nn

HIDDEN, LAYERS, VOCAB = 16, 8, 64


class _Decoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(nn.Linear(HIDDEN, HIDDEN) for _ in range(LAYERS))
        self.layers_to_capture: list[int] = []

    def forward(self, input_ids, aux):
        h = self.embed_tokens(input_ids)  # [N, H]
        for i, layer in enumerate(self.layers):
            if i in self.layers_to_capture:
                aux.append(h)  # the input of layer i
            h = torch.tanh(layer(h))
        return h, aux


class _Logits(nn.Module):
    def forward(self, input_ids, hidden_states, lm_head, forward_batch, aux_hidden_states=None):
        return hidden_states @ lm_head.weight.T  # [N, V]


class _CausalLM(nn.Module):
    packs_aux = False

    def __init__(self, config=None, quant_config=None, prefix: str = ""):
        super().__init__()
        self.model = _Decoder()
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.logits_processor = _Logits()
        self.capture_aux_hidden_states = False

    @torch.no_grad()
    def forward(self, input_ids, positions, forward_batch):
        tokens = forward_batch.input_ids if input_ids is None else input_ids
        if self.packs_aux:
            from sglang.srt.layers.aux_hidden_states import AuxHiddenStatePacker

            collector = AuxHiddenStatePacker(len(self.model.layers_to_capture))
        else:
            collector = []
        hidden, aux = self.model(tokens, collector)
        if self.capture_aux_hidden_states:
            aux = aux.finalize() if self.packs_aux else aux
        else:
            aux = None
        return self.logits_processor(input_ids, hidden, self.lm_head, forward_batch, aux)


class LlamaForCausalLM(_CausalLM):
    pass


class DeepseekV3ForCausalLM(_CausalLM):
    packs_aux = True


class KimiK25ForConditionalGeneration(nn.Module):
    def __init__(self, config=None, quant_config=None, prefix: str = ""):
        super().__init__()
        self.language_model = DeepseekV3ForCausalLM()

    @property
    def model(self):
        return self.language_model

    def forward(self, input_ids, positions, forward_batch):
        return self.language_model(None, positions, forward_batch)  # as mm_utils calls it


EntryClass = [LlamaForCausalLM, DeepseekV3ForCausalLM, KimiK25ForConditionalGeneration]
