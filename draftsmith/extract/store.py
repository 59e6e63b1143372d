"""The hidden-state shard store: many samples per safetensors shard, an index written last.

A shard concatenates the tokens of its samples:
    input_ids [T] int64, loss_mask [T] uint8, aux [T, K*H], final [T, H], offsets [n+1] int64
`store.json` lists every shard with its sample ids, token counts and sha256, plus what the
tensors mean (target fingerprint, canonical aux layer ids, dtype), and is checked on read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from draftsmith.artifacts import atomic_path, atomic_write_json, sha256_file

INDEX_FILE = "store.json"


@dataclass
class Sample:
    id: str
    input_ids: torch.Tensor  # [T] int64
    loss_mask: torch.Tensor  # [T] uint8
    aux: torch.Tensor  # [T, K*H]
    final: torch.Tensor  # [T, H], after the target's final norm


class ShardWriter:
    def __init__(self, root: str | Path, split: str, shard_tokens: int):
        self.root, self.split, self.shard_tokens = Path(root), split, shard_tokens
        self.shards: list[dict[str, Any]] = []
        self._pending: list[Sample] = []
        self._pending_tokens = 0

    def add(self, sample: Sample) -> None:
        self._pending.append(sample)
        self._pending_tokens += len(sample.input_ids)
        if self._pending_tokens >= self.shard_tokens:
            self.flush()

    def flush(self) -> None:
        if not self._pending:
            return
        name = f"{self.split}-{len(self.shards):05d}.safetensors"
        lengths = [len(s.input_ids) for s in self._pending]
        tensors = {
            "input_ids": torch.cat([s.input_ids for s in self._pending]),  # [T]
            "loss_mask": torch.cat([s.loss_mask for s in self._pending]),  # [T]
            "aux": torch.cat([s.aux for s in self._pending]).contiguous(),  # [T, K*H]
            "final": torch.cat([s.final for s in self._pending]).contiguous(),  # [T, H]
            "offsets": torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()]),  # [n+1]
        }
        with atomic_path(self.root / name) as tmp:
            save_file(tensors, str(tmp))
        self.shards.append({"file": name, "ids": [s.id for s in self._pending],
                            "tokens": lengths, "sha256": sha256_file(self.root / name)})
        self._pending, self._pending_tokens = [], 0

    def close(self) -> list[dict[str, Any]]:
        self.flush()
        return self.shards


def write_index(root: str | Path, meta: dict[str, Any], splits: dict[str, list[dict]]) -> None:
    atomic_write_json(Path(root) / INDEX_FILE, {**meta, "splits": splits})


class StoreError(ValueError):
    pass


class ShardReader:
    """Reads samples back, checking each shard against the index before trusting it."""

    def __init__(self, root: str | Path, verify_checksums: bool = True):
        self.root = Path(root)
        index_path = self.root / INDEX_FILE
        if not index_path.is_file():
            raise StoreError(f"{self.root}: no {INDEX_FILE}; the extraction did not finish")
        self.index = json.loads(index_path.read_text())
        self.verify_checksums = verify_checksums

    @property
    def aux_layer_ids(self) -> list[int]:
        return self.index["aux_layer_ids"]

    def num_tokens(self, split: str) -> int:
        return sum(sum(s["tokens"]) for s in self.index["splits"].get(split, []))

    def samples(self, split: str):
        hidden = self.index["hidden_size"]
        k = len(self.index["aux_layer_ids"])
        for shard in self.index["splits"].get(split, []):
            path = self.root / shard["file"]
            if self.verify_checksums and sha256_file(path) != shard["sha256"]:
                raise StoreError(f"{path}: checksum does not match {INDEX_FILE}; the shard is "
                                 "corrupt, delete the extract output and run extract again")
            with safe_open(str(path), framework="pt") as f:
                tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
            offsets = tensors["offsets"].tolist()
            expected = [0, *torch.tensor(shard["tokens"]).cumsum(0).tolist()]
            total = offsets[-1]
            if (offsets != expected or tensors["aux"].shape != (total, k * hidden)
                    or tensors["final"].shape != (total, hidden)):
                raise StoreError(f"{path}: shapes or token counts do not match {INDEX_FILE}")
            for i, sample_id in enumerate(shard["ids"]):
                a, b = offsets[i], offsets[i + 1]
                yield Sample(sample_id, tensors["input_ids"][a:b], tensors["loss_mask"][a:b],
                             tensors["aux"][a:b], tensors["final"][a:b])
