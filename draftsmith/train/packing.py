"""Pack samples into rows of a fixed token budget; attention never crosses samples."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields

import torch

from draftsmith.extract.store import Sample


@dataclass
class PackedRow:
    input_ids: torch.Tensor  # [T] int64
    loss_mask: torch.Tensor  # [T] bool
    aux: torch.Tensor  # [T, K*H]
    final: torch.Tensor  # [T, H]
    position_ids: torch.Tensor  # [T] restarts at 0 in each sample
    document_ids: torch.Tensor  # [T] index of the sample within the row
    target_argmax: torch.Tensor | None = None  # [T] int32 when every sample's store has it
    # (start, end) of each document, padding included, known on the host: the merged TTT
    # attention kernels run once per document (draftsmith/model/ttt_attention.py).
    documents: tuple[tuple[int, int], ...] = ()

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    def tensors(self) -> list[torch.Tensor]:
        return [t for f in fields(self) if isinstance(t := getattr(self, f.name), torch.Tensor)]

    def map(self, fn) -> PackedRow:
        """fn applied to every tensor; the host-side fields are kept."""
        return PackedRow(*(fn(t) if isinstance(t := getattr(self, f.name), torch.Tensor) else t
                           for f in fields(self)))


class RowPrefetcher:
    """Builds the next rows on a background thread while the current row trains: the samples
    are concatenated straight into pinned host memory and copied to the GPU on a side stream.
    Building an 8192-token row of an 8B-shaped target moves ~270 MB through host memory; on
    the training thread that took longer than the GPU's step, leaving the GPU idle. On a CPU
    rows are built on the calling thread when waited for, and so are online rows."""

    def __init__(self, device: torch.device, background: bool = True):
        """background=False: build each row when it is waited for, on the calling thread
        (online rows: the target's forward runs on the training stream)."""
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" and background \
            else None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="row-prefetch") \
            if self.stream is not None else None

    def start(self, build: Callable[[bool], PackedRow | None]):
        """build(pin) makes a row on the host (pinned when pin is true), or returns None."""
        if self._pool is None:
            return build
        return self._pool.submit(self._to_device, build)

    def _to_device(self, build) -> tuple[PackedRow | None, torch.cuda.Event | None]:
        row = build(True)
        if row is None:
            return None, None
        with torch.cuda.stream(self.stream):
            on_device = row.map(lambda t: t.to(self.device, non_blocking=True))
            copied = torch.cuda.Event()
            copied.record(self.stream)
        return on_device, copied

    def wait(self, pending) -> PackedRow | None:
        if self._pool is None:
            return pending(False)
        row, copied = pending.result()
        if row is None:
            return None
        current = torch.cuda.current_stream(self.device)
        current.wait_event(copied)
        for tensor in row.tensors():  # used on the compute stream from here on
            tensor.record_stream(current)
        return row

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)


def plan_rows(samples: list[Sample], row_tokens: int) -> list[list[Sample]]:
    """First-fit in the given order: which samples share each row (no tensors are copied).

    Each sample goes to the first row with room for it, found in O(log rows) with a max-tree
    over the rows' free space (a linear scan is hours for millions of samples)."""
    size = 1
    while size < max(1, len(samples)):
        size *= 2
    free = [0] * (2 * size)  # free[size + i]: room left in row i; inner nodes: max of children
    rows: list[list[Sample]] = []
    for sample in samples:
        n = min(len(sample.input_ids), row_tokens)
        if free[1] >= n:
            node = 1
            while node < size:  # leftmost leaf with room
                node = 2 * node if free[2 * node] >= n else 2 * node + 1
            row = node - size
        else:
            row = len(rows)
            rows.append([])
            node = size + row
            free[node] = row_tokens
        rows[row].append(sample)
        free[node] -= n
        node //= 2
        while node:
            free[node] = max(free[2 * node], free[2 * node + 1])
            node //= 2
    return rows


def concat_row(samples: list[Sample], row_tokens: int, pad_to: int | None = None,
               pin: bool = False) -> PackedRow:
    """The samples of one row laid end to end (each cut to row_tokens), in one copy, in
    pinned memory if pin. pad_to: pad to that many tokens so every row has one shape
    (compiled kernels are built once); padding is its own document (id -1) of zeros with no
    loss, so it changes no real token's attention, loss or metric."""
    parts = [(s, min(len(s.input_ids), row_tokens)) for s in samples]
    real = sum(n for _, n in parts)
    length = real if pad_to is None else pad_to
    if length < real:
        raise ValueError(f"row of {real} tokens is longer than the pad length {pad_to}")

    def laid_out(pieces: list[torch.Tensor], fill: int = 0) -> torch.Tensor:
        # Where the pieces are (online rows: on the GPU already), pinned if asked on the host.
        out = torch.empty((length, *pieces[0].shape[1:]), dtype=pieces[0].dtype,
                          device=pieces[0].device,
                          pin_memory=pin and pieces[0].device.type == "cpu")  # [L, ...]
        torch.cat(pieces, out=out[:real])
        out[real:] = fill
        return out

    argmax = None
    if all(s.target_argmax is not None for s in samples):
        argmax = laid_out([s.target_argmax[:n] for s, n in parts])  # [L]
    ends = list(itertools.accumulate(n for _, n in parts)) + ([length] if length > real else [])
    return PackedRow(
        input_ids=laid_out([s.input_ids[:n] for s, n in parts]),  # [L]
        loss_mask=laid_out([s.loss_mask[:n].bool() for s, n in parts]),  # [L]
        aux=laid_out([s.aux[:n] for s, n in parts]),  # [L, K*H]
        final=laid_out([s.final[:n] for s, n in parts]),  # [L, H]
        position_ids=laid_out([torch.arange(n) for _, n in parts]),  # [L]
        document_ids=laid_out([torch.full((n,), i) for i, (_, n) in enumerate(parts)],
                              fill=-1),  # [L]
        target_argmax=argmax,
        documents=tuple(zip([0, *ends[:-1]], ends, strict=True)),
    )


def padding_row(like: Sample, length: int, device: torch.device | str = "cpu") -> PackedRow:
    """A row of `length` padding tokens with the dtypes and widths of `like`'s tensors, made on
    `device`: no loss-masked token, so its loss and every gradient are exactly zero. Under
    FSDP a rank with no row left in a step runs it, because every rank must join every
    forward's and backward's collectives."""
    return PackedRow(
        input_ids=torch.zeros(length, dtype=like.input_ids.dtype, device=device),  # [L]
        loss_mask=torch.zeros(length, dtype=torch.bool, device=device),  # [L]
        aux=torch.zeros(length, like.aux.shape[1], dtype=like.aux.dtype,
                        device=device),  # [L, K*H]
        final=torch.zeros(length, like.final.shape[1], dtype=like.final.dtype,
                          device=device),  # [L, H]
        position_ids=torch.zeros(length, dtype=torch.int64, device=device),  # [L]
        document_ids=torch.full((length,), -1, device=device),  # [L]
        target_argmax=None if like.target_argmax is None else
        torch.zeros(length, dtype=like.target_argmax.dtype, device=device),  # [L]
        documents=((0, length),),
    )
