"""Online training (`train.mode: online`): the target's prefill feeds the packed rows directly,
and no hidden state reaches the disk.

What the extract stage would have stored for a sample (aux states of `extract.aux_layer_ids`,
the final state after the target's norm, both cast to `extract.dtype`, and the target's argmax)
is computed by the same capture (`draftsmith/extract/capture.py`) when the row that holds the
sample is built. The samples are taken in the store's order (the extract stage's shard plan),
so the trainer's seeded shuffle, packing, loss, metrics, validation, checkpoints and resume are
the offline ones; only where a row's tensors come from differs. The cost: one target forward
per sample per epoch (offline pays it once, plus 32.8 kB a token of disk for an 8B target).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from draftsmith.artifacts import Descriptor
from draftsmith.config import ExtractConfig, TargetConfig, capture_dtype
from draftsmith.extract.capture import real_token_index
from draftsmith.extract.store import Sample


@dataclass
class TokenSample:
    """A sample before the target has run: what packing needs (its length) and the tokens."""

    id: str
    input_ids: torch.Tensor  # [T] int64
    loss_mask: torch.Tensor  # [T] uint8


def token_samples(merged: Descriptor, split: str, shard_tokens: int) -> list[TokenSample]:
    """The split's samples in the order the extract stage's store serves them (its shards
    sorted by length, then id), so an online run plans the rows an offline run plans."""
    from draftsmith.data.merge import read_split
    from draftsmith.extract.batching import plan_shards

    rows = read_split(merged, split)
    by_id = {r["id"]: r for r in rows}
    return [TokenSample(i, torch.tensor(by_id[i]["input_ids"], dtype=torch.long),
                        torch.tensor(by_id[i]["loss_mask"], dtype=torch.uint8))
            for spec in plan_shards(split, rows, shard_tokens) for i in spec.ids]


class OnlineTarget:
    """The target on this rank's device, run over the samples of a row as the extract stage
    runs it over a shard's batches (right-padded, no attention mask, same batch limits)."""

    def __init__(self, target_path: str | Path, target_cfg: TargetConfig,
                 extract_cfg: ExtractConfig, aux_layer_ids: list[int], device: torch.device):
        from draftsmith.extract.capture import HiddenStateCapture
        from draftsmith.extract.stage import load_model
        from draftsmith.target import DTYPES

        self.device = device
        self.model = load_model(str(target_path), str(device),
                                capture_dtype(extract_cfg, target_cfg), None)
        self.capture = HiddenStateCapture(self.model, aux_layer_ids)
        self.store_dtype = DTYPES[extract_cfg.dtype]
        self.batch_size, self.batch_tokens = extract_cfg.batch_size, extract_cfg.batch_tokens
        config = self.model.config.get_text_config()
        self.widths = (len(aux_layer_ids) * config.hidden_size, config.hidden_size)

    def samples(self, tokens: list[TokenSample]) -> list[Sample]:
        """The samples with their hidden states and target argmax, on this device."""
        from draftsmith.extract.batching import plan_batches

        # Longest first within a row is not needed: the batch plan only groups neighbours.
        order = sorted(range(len(tokens)), key=lambda i: (len(tokens[i].input_ids), tokens[i].id))
        lengths = [len(tokens[i].input_ids) for i in order]
        out: dict[int, Sample] = {}
        for positions in plan_batches(lengths, self.batch_size, self.batch_tokens).batches:
            batch = [order[p] for p in positions]
            sizes = [len(tokens[i].input_ids) for i in batch]
            input_ids = torch.zeros(len(batch), max(sizes), dtype=torch.long)  # [B, L]
            for row, i in enumerate(batch):
                input_ids[row, : sizes[row]] = tokens[i].input_ids
            # One gather, cast and argmax a batch: per sample they were ~5 kernels each, and
            # a row of short chat answers holds ~160 samples.
            aux, final, argmax = self.capture.real_tokens(  # [N, K*H], [N, H], [N]
                input_ids.to(self.device), real_token_index(sizes, max(sizes)))
            pieces = zip(aux.to(self.store_dtype).split(sizes),  # [n, K*H] each
                         final.to(self.store_dtype).split(sizes),  # [n, H] each
                         argmax.split(sizes), strict=True)  # [n] each
            for i, (sample_aux, sample_final, sample_argmax) in zip(batch, pieces, strict=True):
                out[i] = Sample(
                    id=tokens[i].id, input_ids=tokens[i].input_ids, loss_mask=tokens[i].loss_mask,
                    aux=sample_aux, final=sample_final, target_argmax=sample_argmax)
        return [out[i] for i in range(len(tokens))]

    def padding_like(self) -> Sample:
        """A sample of no tokens with a row's widths and dtypes (what FSDP pads with)."""
        aux_width, hidden = self.widths
        return Sample("padding", torch.zeros(0, dtype=torch.long),
                      torch.zeros(0, dtype=torch.uint8),
                      torch.zeros(0, aux_width, dtype=self.store_dtype),
                      torch.zeros(0, hidden, dtype=self.store_dtype),
                      torch.zeros(0, dtype=torch.int32))
