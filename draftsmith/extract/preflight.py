"""Disk preflight for extraction: will the hidden-state store fit where it is to be written?

The seeds' store took ~4.6 TB for 87.8M tokens; finding out at 90% is a lost day. The estimate
is tokens x bytes per token of the shard store (draftsmith/extract/store.py): per token, K aux
states and the final state of H values each in the store dtype, an int64 id, a uint8 mask and
an int32 target argmax (the SGLang backend stores no argmax: 4 bytes a token of margin there).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq

from draftsmith.artifacts import Descriptor
from draftsmith.config import ExtractConfig
from draftsmith.diskspace import free_bytes
from draftsmith.errors import InputError
from draftsmith.figures import TargetFigures

log = logging.getLogger(__name__)

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# safetensors headers, offsets, the index and filesystem slack: a margin, not a measurement.
OVERHEAD = 0.02


class DiskSpaceError(InputError, RuntimeError):
    pass


@dataclass
class DiskEstimate:
    tokens: int
    bytes_per_token: int
    needed_bytes: int
    free_bytes: int
    destination: str

    @property
    def fits(self) -> bool:
        return self.needed_bytes <= self.free_bytes


def bytes_per_token(hidden_size: int, num_aux_layers: int, dtype: str) -> int:
    """aux [K*H] + final [H] in the store dtype, input_ids int64, loss_mask uint8,
    target_argmax int32."""
    return (num_aux_layers + 1) * hidden_size * DTYPE_BYTES[dtype] + 8 + 1 + 4


def estimate_store_bytes(tokens: int, hidden_size: int, num_aux_layers: int, dtype: str) -> int:
    return int(tokens * bytes_per_token(hidden_size, num_aux_layers, dtype) * (1 + OVERHEAD))


def merged_tokens(merged: Descriptor) -> int:
    """Tokens extraction will store: every split of the merged data."""
    counts = merged.counts
    if "train_tokens" in counts and "validation_tokens" in counts:
        return counts["train_tokens"] + counts["validation_tokens"]
    total = 0  # older merge outputs count only the train split: read the lengths
    for split in ("train", "validation"):
        path = merged.dir / f"{split}.parquet"
        if path.is_file():
            column = pq.read_table(path, columns=["input_ids"]).column("input_ids")
            total += sum(len(ids) for ids in column.to_pylist())
    return total


def check_extract_disk(cfg: ExtractConfig, merged: Descriptor, target: Descriptor,
                       destination: str | Path, aux_layer_ids: list[int]) -> DiskEstimate:
    """Estimate the store's size and compare it with the free space at `destination`; raise
    DiskSpaceError, before any forward pass, when it will not fit."""
    tokens = merged_tokens(merged)
    hidden = TargetFigures.of(target).hidden_size
    per_token = bytes_per_token(hidden, len(aux_layer_ids), cfg.dtype)
    estimate = DiskEstimate(
        tokens=tokens, bytes_per_token=per_token,
        needed_bytes=estimate_store_bytes(tokens, hidden,
                                          len(aux_layer_ids), cfg.dtype),
        free_bytes=free_bytes(destination), destination=str(destination))
    gib = 1 << 30
    log.info("extract preflight: %d tokens x %d bytes/token (%d aux layers + final, hidden %d, "
             "%s) = %.2f GiB needed, %.2f GiB free at %s", tokens, per_token,
             len(aux_layer_ids), hidden, cfg.dtype,
             estimate.needed_bytes / gib, estimate.free_bytes / gib, destination)
    if not estimate.fits:
        smaller = (" or store bfloat16 (extract.dtype: bfloat16 halves it)"
                   if cfg.dtype == "float32" else "")
        raise DiskSpaceError(
            f"extract will not fit: the hidden-state store needs about "
            f"{estimate.needed_bytes / gib:.1f} GiB ({tokens} tokens x {per_token} bytes/token: "
            f"{len(aux_layer_ids)} aux layers + the final state of {hidden}"
            f" values in {cfg.dtype}, plus ids and mask) but {destination} has "
            f"{estimate.free_bytes / gib:.1f} GiB free. Free space, point run_root at a larger "
            f"disk{smaller}, or cut the data (data.sources[].limit, merge.max_length)")
    return estimate


# The rule (docs/training.md, "Online or offline"): a store that does not fit -> online; one that
# fits easily, trained on for several epochs -> offline (online repeats the target's forward
# every epoch, offline pays it once).
EASY_FIT = 0.5  # the store takes at most this share of the free disk
MANY_EPOCHS = 2


def suggest_train_mode(cfg: ExtractConfig, train, merged: Descriptor, target: Descriptor,
                       destination: str | Path, aux_layer_ids: list[int]) -> str | None:
    """The mode this run should use by the rule, logged as a warning when it is not the one
    configured; returns the suggestion (None when the configured mode is right)."""
    hidden = TargetFigures.of(target).hidden_size
    needed = estimate_store_bytes(merged_tokens(merged), hidden, len(aux_layer_ids), cfg.dtype)
    free = free_bytes(destination)
    gib = 1 << 30
    if train.mode == "offline" and needed > free:
        log.warning("train.mode: offline needs a %.1f GiB hidden-state store and %s has %.1f GiB "
                    "free: set train.mode: online (the target feeds the drafter directly, "
                    "nothing is stored)", needed / gib, destination, free / gib)
        return "online"
    if train.mode == "online" and needed <= EASY_FIT * free and train.epochs >= MANY_EPOCHS:
        log.warning("train.mode: online repeats the target's forward in each of the %d epochs; "
                    "the store would take %.1f GiB of %.1f GiB free: train.mode: offline pays "
                    "the forward once", train.epochs, needed / gib, free / gib)
        return "offline"
    return None
