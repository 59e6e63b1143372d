"""The hidden-state shard store: many samples per safetensors shard, an index written last.

A shard concatenates the tokens of its samples:
    input_ids [T] int64, loss_mask [T] uint8, aux [T, K*H], final [T, H], offsets [n+1] int64
and, from the transformers backend, target_argmax [T] int32: the target's greedy next token at
each position (its full-vocab argmax), so training never recomputes full-vocab logits for the
"target argmax in the draft vocab" mask. Stores without it (the SGLang backend, older stores)
are read as before and the trainer computes the argmax itself.
`store.json` lists every shard with its sample ids, token counts, size and sha256, plus what
the tensors mean (target fingerprint, canonical aux layer ids, dtype), and is checked on read.

Resume: each shard is written to a temp name, fsynced and renamed, then a receipt
(`.receipts/<shard>.json`, with its sha256) is written the same way. A shard counts as done only
when its receipt exists and the file's size matches it; anything else is redone, so a kill -9
at any moment leaves nothing that a resumed run or the reader would take for finished work.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import mmap
import os
import queue
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from draftsmith.artifacts import atomic_path, atomic_write_json, sha256_file
from draftsmith.diskspace import DiskFullError
from draftsmith.errors import InputError

INDEX_FILE = "store.json"
RECEIPTS = ".receipts"
STORE_VERSION = 2

_ST_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32,
              "I64": torch.int64, "I32": torch.int32, "U8": torch.uint8}
_DTYPE_NAMES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class Sample:
    id: str
    input_ids: torch.Tensor  # [T] int64
    loss_mask: torch.Tensor  # [T] uint8
    aux: torch.Tensor  # [T, K*H]
    final: torch.Tensor  # [T, H], after the target's final norm
    target_argmax: torch.Tensor | None = None  # [T] int32, the target's full-vocab argmax


@dataclass(frozen=True)
class ShardSpec:
    """One shard decided before extraction: its file name and exactly which samples it holds,
    so a rerun (or another rank) computes the same shard from the same samples."""

    split: str
    index: int
    ids: tuple[str, ...]
    tokens: tuple[int, ...]

    @property
    def file(self) -> str:
        return f"{self.split}-{self.index:05d}.safetensors"

    @property
    def num_tokens(self) -> int:
        return sum(self.tokens)


def shard_tensors(samples: list[Sample]) -> dict[str, torch.Tensor]:
    lengths = torch.tensor([len(s.input_ids) for s in samples])  # [n]
    tensors = {
        "input_ids": torch.cat([s.input_ids for s in samples]),  # [T]
        "loss_mask": torch.cat([s.loss_mask for s in samples]),  # [T]
        "aux": torch.cat([s.aux for s in samples]).contiguous(),  # [T, K*H]
        "final": torch.cat([s.final for s in samples]).contiguous(),  # [T, H]
        "offsets": torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]),  # [n+1]
    }
    if all(s.target_argmax is not None for s in samples):
        tensors["target_argmax"] = torch.cat([s.target_argmax for s in samples])  # [T] int32
    return tensors


_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}


def _as_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().view(torch.uint8).numpy()).cast("B")


def write_safetensors(path: str | Path, tensors: dict[str, torch.Tensor | list[torch.Tensor]],
                      metadata: dict[str, str] | None = None) -> tuple[int, str]:
    """Write a safetensors file atomically; returns (bytes, sha256).

    A tensor may be given as a list of row blocks (the batches of a shard): they are streamed
    to the file one after another, so the tensor is never concatenated in memory. Streaming
    buffers through hashlib and the file keeps the GIL free (serialising through safetensors'
    `save` held it for two full copies per shard, which starved the compute thread)."""
    header: dict[str, Any] = {}
    chunks: list[torch.Tensor] = []
    position = 0
    for name in sorted(tensors):
        value = tensors[name]
        blocks = value if isinstance(value, list) else [value]
        shape = [sum(b.shape[0] for b in blocks), *blocks[0].shape[1:]]
        size = sum(b.numel() * b.element_size() for b in blocks)
        header[name] = {"dtype": _ST_NAMES[blocks[0].dtype], "shape": shape,
                        "data_offsets": [position, position + size]}
        chunks += blocks
        position += size
    if metadata:
        header["__metadata__"] = metadata
    text = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    digest = hashlib.sha256()
    with atomic_path(path, 8 + len(text) + position) as tmp, open(tmp, "wb") as f:
        for part in (len(text).to_bytes(8, "little"), text, *map(_as_bytes, chunks)):
            digest.update(part)
            f.write(part)
    return 8 + len(text) + position, digest.hexdigest()


def gather_shard(capture: Callable[[str, list[int]], dict[str, torch.Tensor]], spec: ShardSpec,
                 rows: dict[str, dict], store_dtype: torch.dtype, pool: ThreadPoolExecutor
                 ) -> dict[str, Any]:
    """A shard's tensors (write_shard's layout) from one capture per sample, run on the pool:
    the server backends, where each sample is one request. capture(sample_id, input_ids)
    returns input_ids [n], aux [n, K*H] and final [n, H]."""
    futures = [pool.submit(capture, i, rows[i]["input_ids"]) for i in spec.ids]
    results = [f.result() for f in futures]
    lengths = torch.tensor(spec.tokens)  # [n]
    return {
        "input_ids": torch.cat([r["input_ids"] for r in results]),  # [T]
        "loss_mask": torch.cat([torch.tensor(rows[i]["loss_mask"], dtype=torch.uint8)
                                for i in spec.ids]),  # [T]
        "aux": [r["aux"].to(store_dtype) for r in results],  # blocks of [n, K*H]
        "final": [r["final"].to(store_dtype) for r in results],  # blocks of [n, H]
        "offsets": torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]),  # [n+1]
    }


def write_shard(root: str | Path, spec: ShardSpec,
                tensors: dict[str, torch.Tensor | list[torch.Tensor]]) -> dict[str, Any]:
    """Write one shard atomically, then its receipt; returns the record for the index."""
    root = Path(root)
    offsets = tensors["offsets"]
    assert isinstance(offsets, torch.Tensor)
    if offsets.tolist()[1:] != torch.tensor(spec.tokens).cumsum(0).tolist():
        raise ValueError(f"{spec.file}: token counts {list(spec.tokens)} do not match the "
                         f"tensors' offsets {offsets.tolist()}")
    size, sha256 = write_safetensors(root / spec.file, tensors)
    record = {"file": spec.file, "ids": list(spec.ids), "tokens": list(spec.tokens),
              "bytes": size, "sha256": sha256}
    atomic_write_json(root / RECEIPTS / f"{spec.file}.json", record)
    return record


def finished_shard(root: str | Path, spec: ShardSpec) -> dict[str, Any] | None:
    """The receipt of a shard that is fully written and belongs to this plan, else None."""
    root = Path(root)
    receipt = root / RECEIPTS / f"{spec.file}.json"
    path = root / spec.file
    try:
        record = json.loads(receipt.read_text())
        size = path.stat().st_size
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    if (record.get("ids") != list(spec.ids) or record.get("tokens") != list(spec.tokens)
            or record.get("bytes") != size):
        return None
    return record


def remove_partial_files(root: str | Path) -> int:
    """Temp files of writes a crash interrupted; returns how many were removed."""
    removed = 0
    for p in Path(root).rglob(".*.tmp"):
        p.unlink(missing_ok=True)
        removed += 1
    return removed


class AsyncShardWriter:
    """Writes shards on background threads so the forward passes never wait on disk.

    The queue is bounded: when `max_pending` shards are waiting, `submit` blocks, which keeps
    host memory at most (max_pending + threads) shards. `submit` takes a callable that returns
    the tensors, so device-to-host copies started asynchronously are waited for on the writer
    thread, not on the compute thread."""

    def __init__(self, root: str | Path, max_pending: int = 2, threads: int = 2,
                 on_written=None):
        self.root, self.on_written = Path(root), on_written
        self._queue: queue.Queue = queue.Queue(maxsize=max_pending)
        self._lock = threading.Lock()
        self.records: dict[str, dict[str, Any]] = {}
        self.bytes_written = 0
        self._error: BaseException | None = None
        self._threads = [threading.Thread(target=self._run, daemon=True, name=f"shard-writer-{i}")
                         for i in range(threads)]
        for t in self._threads:
            t.start()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                spec, make_tensors = item
                if self._error is None:
                    record = write_shard(self.root, spec, make_tensors())
                    with self._lock:
                        self.records[spec.file] = record
                        self.bytes_written += record["bytes"]
                    if self.on_written is not None:
                        self.on_written(record)
            except BaseException as err:  # surfaced on the compute thread by submit/close
                self._error = err
            finally:
                self._queue.task_done()

    def _raise_if_failed(self) -> None:
        if isinstance(self._error, DiskFullError):  # it names the shard and the fix already
            raise self._error
        if self._error is not None:
            raise RuntimeError(f"writing a shard under {self.root} failed: {self._error}"
                               ) from self._error

    def submit(self, spec: ShardSpec, make_tensors) -> None:
        self._raise_if_failed()
        self._queue.put((spec, make_tensors))

    def close(self) -> dict[str, dict[str, Any]]:
        for _ in self._threads:
            self._queue.put(None)
        for t in self._threads:
            t.join()
        self._raise_if_failed()
        return self.records


def write_index(root: str | Path, meta: dict[str, Any], splits: dict[str, list[dict]]) -> None:
    atomic_write_json(Path(root) / INDEX_FILE, {"store_version": STORE_VERSION, **meta,
                                               "splits": splits})


class StoreError(InputError, ValueError):
    pass


def _redo(root: Path) -> str:
    return f"delete {root} and run the extract stage again"


class _MappedShard:
    """A shard's tensors as zero-copy views of a memory map of the file."""

    def __init__(self, path: Path, fix: str):
        size = path.stat().st_size
        if size < 8:
            raise StoreError(f"{path}: {size} bytes, too short for a safetensors file; {fix}")
        with open(path, "rb") as f:
            # ACCESS_COPY: writable pages for torch.frombuffer, never written back to the file.
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        header_len = int.from_bytes(self._map[:8], "little")
        if 8 + header_len > size:
            raise StoreError(f"{path}: its header claims {header_len} bytes, more than the file's "
                             f"{size}; the shard is truncated or not a safetensors file: {fix}")
        try:
            header = json.loads(self._map[8:8 + header_len])
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise StoreError(f"{path}: not a safetensors file ({err}); {fix}") from None
        if not isinstance(header, dict):
            raise StoreError(f"{path}: not a safetensors file (its header is no object); {fix}")
        header.pop("__metadata__", None)
        start = 8 + header_len
        self.tensors: dict[str, torch.Tensor] = {}
        for name, info in header.items():
            try:
                dtype = _ST_DTYPES.get(info["dtype"])
                if dtype is None:
                    raise StoreError(f"{path}: tensor {name!r} has unsupported dtype "
                                     f"{info['dtype']}")
                begin, end = info["data_offsets"]
                if not 0 <= begin <= end <= size - start:
                    raise StoreError(f"{path}: tensor {name!r} lies at bytes {begin}..{end} past "
                                     f"the header, beyond the file's end; the shard is "
                                     f"truncated: {fix}")
                count = (end - begin) // torch.tensor([], dtype=dtype).element_size()
                flat = (torch.frombuffer(self._map, dtype=dtype, count=count, offset=start + begin)
                        if count else torch.empty(0, dtype=dtype))
                self.tensors[name] = flat.view(info["shape"])
            except StoreError:
                raise
            except (KeyError, TypeError, ValueError, RuntimeError) as err:
                raise StoreError(f"{path}: the header entry of tensor {name!r} is damaged "
                                 f"({type(err).__name__}: {err}); {fix}") from None


class ShardReader:
    """Serves samples by id from memory-mapped shards, checking each shard against the index
    the first time it is opened: size and sha256, tensor names, dtypes, shapes, offsets."""

    def __init__(self, root: str | Path, verify_checksums: bool = True):
        self.root = Path(root)
        index_path = self.root / INDEX_FILE
        if not index_path.is_file():
            raise StoreError(f"{self.root}: no {INDEX_FILE}; the extraction did not finish "
                             "(run the extract stage again; it resumes from finished shards)")
        try:
            self.index = json.loads(index_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise StoreError(f"{index_path}: not valid JSON ({err}); the index is damaged: "
                             f"{_redo(self.root)}") from None
        missing = [k for k in ("splits", "aux_layer_ids", "hidden_size", "dtype")
                   if not isinstance(self.index, dict) or k not in self.index]
        if missing:
            raise StoreError(f"{index_path}: missing keys {missing}; it was not written by this "
                             f"draftsmith's extract stage or is damaged: {_redo(self.root)}")
        self.verify_checksums = verify_checksums
        self._where: dict[str, tuple[dict[str, Any], int]] = {}
        for split, shards in self.index["splits"].items():
            for number, shard in enumerate(shards):
                absent = [k for k in ("file", "ids", "tokens", "sha256") if k not in shard]
                if absent:
                    raise StoreError(f"{index_path}: shard {number} of split {split!r} lacks "
                                     f"{absent}; {_redo(self.root)}")
                for position, sample_id in enumerate(shard["ids"]):
                    if sample_id in self._where:
                        raise StoreError(f"{index_path}: sample id {sample_id!r} appears in "
                                         f"{self._where[sample_id][0]['file']} and "
                                         f"{shard['file']}; ids must be unique")
                    self._where[sample_id] = (shard, position)
        self._open: dict[str, _MappedShard] = {}

    @property
    def aux_layer_ids(self) -> list[int]:
        return self.index["aux_layer_ids"]

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, sample_id: str) -> bool:
        return sample_id in self._where

    def ids(self, split: str) -> list[str]:
        return [i for shard in self.index["splits"].get(split, []) for i in shard["ids"]]

    def num_tokens(self, split: str) -> int:
        return sum(sum(s["tokens"]) for s in self.index["splits"].get(split, []))

    def _shard(self, shard: dict[str, Any]) -> _MappedShard:
        name = shard["file"]
        if name in self._open:
            return self._open[name]
        path = self.root / name
        if not path.is_file():
            raise StoreError(f"{path}: listed in {INDEX_FILE} but missing; run extract again")
        if "bytes" in shard and path.stat().st_size != shard["bytes"]:
            raise StoreError(f"{path}: {path.stat().st_size} bytes, {INDEX_FILE} says "
                             f"{shard['bytes']}; the shard is truncated or replaced, run extract "
                             "again")
        if self.verify_checksums and sha256_file(path) != shard["sha256"]:
            raise StoreError(f"{path}: checksum does not match {INDEX_FILE}; the shard is "
                             "corrupt, delete the extract output and run extract again")
        mapped = _MappedShard(path, _redo(self.root))
        self._validate(path, shard, mapped.tensors)
        self._open[name] = mapped
        return mapped

    def _validate(self, path: Path, shard: dict[str, Any], t: dict[str, torch.Tensor]) -> None:
        hidden, k = self.index["hidden_size"], len(self.index["aux_layer_ids"])
        dtype = _DTYPE_NAMES[self.index["dtype"]]
        missing = {"input_ids", "loss_mask", "aux", "final", "offsets"} - set(t)
        if missing:
            raise StoreError(f"{path}: tensors {sorted(missing)} missing")
        expected = [0, *torch.tensor(shard["tokens"]).cumsum(0).tolist()]
        total = expected[-1]
        problems = []
        if t["offsets"].tolist() != expected:
            problems.append(f"offsets {t['offsets'].tolist()[:4]}... vs token counts in the index")
        expected_tensors = [("input_ids", (total,), torch.int64),
                            ("loss_mask", (total,), torch.uint8),
                            ("aux", (total, k * hidden), dtype),
                            ("final", (total, hidden), dtype)]
        if "target_argmax" in t:
            expected_tensors.append(("target_argmax", (total,), torch.int32))
        for name, shape, want in expected_tensors:
            if tuple(t[name].shape) != shape or t[name].dtype != want:
                problems.append(f"{name} is {t[name].dtype} {tuple(t[name].shape)}, expected "
                                f"{want} {shape}")
        if problems:
            raise StoreError(f"{path}: shapes, dtypes or token counts do not match "
                             f"{INDEX_FILE}: " + "; ".join(problems))

    def sample(self, sample_id: str) -> Sample:
        """One sample; its tensors are views of the memory-mapped shard (no copy)."""
        if sample_id not in self._where:
            raise KeyError(f"{self.root}: no sample {sample_id!r} in this store")
        shard, position = self._where[sample_id]
        t = self._shard(shard).tensors
        a, b = int(t["offsets"][position]), int(t["offsets"][position + 1])
        argmax = t.get("target_argmax")
        return Sample(sample_id, t["input_ids"][a:b], t["loss_mask"][a:b], t["aux"][a:b],
                      t["final"][a:b], None if argmax is None else argmax[a:b])

    def samples(self, split: str) -> Iterator[Sample]:
        for shard in self.index["splits"].get(split, []):
            for sample_id in shard["ids"]:
                yield self.sample(sample_id)

    def close(self) -> None:
        for mapped in self._open.values():
            mapped.tensors.clear()
            with contextlib.suppress(BufferError):  # views still held elsewhere keep it open
                mapped._map.close()
        self._open.clear()


def free_disk_bytes(path: str | Path) -> int:
    stat = os.statvfs(path)
    return stat.f_bavail * stat.f_frsize
