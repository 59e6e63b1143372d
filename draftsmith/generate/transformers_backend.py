"""In-process generation with transformers: batched, left-padded, greedy or sampled."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Completion:
    text: str
    completion_tokens: int
    finish_reason: str  # "stop" (end of turn) or "length"


class TransformersGenerator:
    def __init__(self, model, tokenizer, *, max_new_tokens: int, temperature: float, top_p: float,
                 seed: int):
        self.model, self.tokenizer = model, tokenizer
        self.max_new_tokens, self.temperature, self.top_p = max_new_tokens, temperature, top_p
        self.generator_seed = seed
        self.eos_id = tokenizer.eos_token_id
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_id

    @torch.inference_mode()
    def complete(self, conversations: list[list[dict[str, str]]]) -> list[Completion]:
        prompts = [
            self.tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True,
                                               return_dict=False)
            for c in conversations
        ]
        width = max(len(p) for p in prompts)
        device = self.model.device
        input_ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)  # [B, P]
        attention_mask = torch.zeros_like(input_ids)  # [B, P]
        for row, prompt in enumerate(prompts):
            input_ids[row, width - len(prompt):] = torch.tensor(prompt)
            attention_mask[row, width - len(prompt):] = 1
        sampling = self.temperature > 0
        if sampling:
            torch.manual_seed(self.generator_seed)
        output = self.model.generate(
            input_ids=input_ids.to(device),
            attention_mask=attention_mask.to(device),
            max_new_tokens=self.max_new_tokens,
            do_sample=sampling,
            temperature=self.temperature if sampling else None,
            top_p=self.top_p if sampling else None,
            top_k=None,
            eos_token_id=self.eos_id,
            pad_token_id=self.pad_id,
        )
        completions = []
        for row in output[:, width:].tolist():
            stopped = self.eos_id in row
            tokens = row[: row.index(self.eos_id)] if stopped else row
            completions.append(Completion(
                text=self.tokenizer.decode(tokens, skip_special_tokens=True),
                completion_tokens=len(tokens) + int(stopped),
                finish_reason="stop" if stopped else "length",
            ))
        return completions
