"""Stage `extract`: run the target over the merged data and store its hidden states.

The work is a list of shards fixed up front (batching.plan_shards). Each shard is computed from
the same batches whoever computes it, written by a background writer and receipted; a rerun
skips receipted shards and redoes the rest. Data parallel: shard k of the pending list goes to
rank k % world, for a world spawned here (extract.data_parallel) or given by torchrun.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import torch

from draftsmith.artifacts import Descriptor, StagePlan, finish_stage
from draftsmith.config import ExtractConfig, TargetConfig, capture_dtype
from draftsmith.data.merge import SPLITS, read_split
from draftsmith.distributed import Dist
from draftsmith.errors import ConfigValueError, WorkerCrashError
from draftsmith.export.layer_ids import aux_layer_ids_for
from draftsmith.extract.batching import plan_batches, plan_shards
from draftsmith.extract.capture import HiddenStateCapture, real_token_index
from draftsmith.extract.store import (
    RECEIPTS,
    AsyncShardWriter,
    ShardSpec,
    finished_shard,
    free_disk_bytes,
    remove_partial_files,
    write_index,
)
from draftsmith.figures import TargetFigures
from draftsmith.hosts import HostPart, range_bounds
from draftsmith.progress import Progress
from draftsmith.target import DTYPES

log = logging.getLogger(__name__)

LAYER_ID_CONVENTION = "output of decoder layer i (= transformers hidden_states[i+1])"


def load_rows(merged: Descriptor) -> dict[str, list[dict]]:
    return {split: read_split(merged, split) for split in SPLITS}


def shard_plan(rows: dict[str, list[dict]], shard_tokens: int) -> list[ShardSpec]:
    return [spec for split in SPLITS for spec in plan_shards(split, rows[split], shard_tokens)]


def load_model(path: str, device: str, dtype: str, device_map: str | None):
    from transformers import AutoModelForCausalLM

    if device_map is not None:  # weights spread over the visible GPUs by accelerate
        import importlib.util

        if importlib.util.find_spec("accelerate") is None:
            raise ConfigValueError(f"extract.device_map={device_map!r} needs the accelerate "
                                   "package: pip install accelerate")
        return AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype],
                                                    device_map=device_map).eval()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype])
    return model.to(device).eval()


class ShardComputer:
    """Runs the capture over one shard's batches and hands the writer a closure that returns
    the shard's tensors once the device-to-host copies have landed."""

    def __init__(self, capture: HiddenStateCapture, device: torch.device, store_dtype,
                 batch_size: int, batch_tokens: int | None):
        self.capture, self.device, self.store_dtype = capture, device, store_dtype
        self.batch_size, self.batch_tokens = batch_size, batch_tokens
        self.real_tokens = self.padded_tokens = 0

    def __call__(self, spec: ShardSpec, rows: dict[str, dict], on_batch=None):
        plan = plan_batches(spec.tokens, self.batch_size, self.batch_tokens)
        self.real_tokens += plan.real_tokens
        self.padded_tokens += plan.padded_tokens
        pinned = self.device.type == "cuda"
        pieces: list[tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        for positions in plan.batches:
            batch = [rows[spec.ids[p]] for p in positions]
            lengths = [spec.tokens[p] for p in positions]
            longest = max(lengths)
            input_ids = torch.zeros(len(batch), longest, dtype=torch.long)  # [B, T]
            for i, row in enumerate(batch):
                input_ids[i, : lengths[i]] = torch.tensor(row["input_ids"])
            flat = real_token_index(lengths, longest)  # [N]
            if pinned:
                input_ids, flat = input_ids.pin_memory(), flat.pin_memory()
            ids_dev = input_ids.to(self.device, non_blocking=True)
            # Right padding under causal attention: no mask needed (see HiddenStateCapture).
            aux, final, argmax = self.capture.real_tokens(ids_dev, flat)  # [N, K*H], [N, H], [N]
            states_device = aux.device  # the last GPU when device_map spreads the model
            aux = aux.to(self.store_dtype).to("cpu", non_blocking=pinned)  # [N, K*H]
            final = final.to(self.store_dtype).to("cpu", non_blocking=pinned)  # [N, H]
            argmax = argmax.to("cpu", non_blocking=pinned)  # [N]
            event = None
            if pinned:  # on the stream that issued the copies
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(states_device))
            pieces.append((event, aux, final, argmax))
            if on_batch is not None:
                on_batch(len(batch), sum(lengths))

        def tensors() -> dict[str, torch.Tensor | list[torch.Tensor]]:
            for event, *_ in pieces:
                if event is not None:
                    event.synchronize()
            ordered = [rows[i] for i in spec.ids]
            lengths = torch.tensor(spec.tokens)  # [n]
            return {
                "input_ids": torch.cat([torch.tensor(r["input_ids"], dtype=torch.long)
                                        for r in ordered]),  # [T]
                "loss_mask": torch.cat([torch.tensor(r["loss_mask"], dtype=torch.uint8)
                                        for r in ordered]),  # [T]
                "aux": [p[1] for p in pieces],  # blocks of [N, K*H], streamed in order
                "final": [p[2] for p in pieces],  # blocks of [N, H]
                "target_argmax": [p[3] for p in pieces],  # blocks of [N] int32
                "offsets": torch.cat([torch.zeros(1, dtype=torch.long),
                                      lengths.cumsum(0)]),  # [n+1]
            }

        return tensors


def extract_shards(cfg: ExtractConfig, target_cfg: TargetConfig, target_path: str,
                   out: Path, pending: list[ShardSpec], rows: dict[str, list[dict]],
                   aux_ids: list[int], dist: Dist | None = None) -> dict[str, Any]:
    """This rank's share of the pending shards: load the target, compute, write. Every rank
    must be given the same `pending` list, taken before any rank started writing."""
    dist = dist or Dist.single()
    rank, world = dist.rank, dist.world
    by_id = {r["id"]: r for split_rows in rows.values() for r in split_rows}
    mine = pending[rank::world]
    figures = {"rank": rank, "shards": len(mine)}
    if not mine:
        return figures
    device = dist.device_name(target_cfg.device)
    model = load_model(target_path, device, capture_dtype(cfg, target_cfg), cfg.device_map)
    if device.startswith("cuda") and cfg.device_map is None:
        torch.cuda.set_device(torch.device(device))
    capture = HiddenStateCapture(model, aux_ids)
    input_device = model.get_input_embeddings().weight.device
    computer = ShardComputer(capture, input_device, DTYPES[cfg.dtype], cfg.batch_size,
                             cfg.batch_tokens)
    writer = AsyncShardWriter(out, max_pending=cfg.writer_queue, threads=cfg.writer_threads)
    total = sum(s.num_tokens for s in mine)
    name = f"extract rank {rank}/{world}" if world > 1 else "extract"
    progress = Progress(name, total=total, unit="token")
    samples = 0

    def on_batch(n_samples: int, n_tokens: int) -> None:
        nonlocal samples
        samples += n_samples
        progress.update(n_tokens, samples=samples,
                        written=f"{writer.bytes_written / 2**30:.2f} GiB",
                        free_disk=f"{free_disk_bytes(out) / 2**30:.1f} GiB")

    started = time.monotonic()
    try:
        for spec in mine:
            writer.submit(spec, computer(spec, by_id, on_batch))
    finally:
        records = writer.close()
    progress.close()
    seconds = time.monotonic() - started
    waste = 1 - computer.real_tokens / computer.padded_tokens if computer.padded_tokens else 0.0
    log.info("%s: %d shards, %d tokens in %.1fs (%.0f tokens/s), padding waste %.1f%%, "
             "%.2f GiB written", name, len(records), total, seconds, total / max(seconds, 1e-9),
             100 * waste, writer.bytes_written / 2**30)
    return {**figures, "tokens": total, "seconds": seconds, "padding_waste": waste,
            "real_tokens": computer.real_tokens, "padded_tokens": computer.padded_tokens}


def _spawned_worker(rank: int, world: int, args: tuple, results: Any) -> None:
    from draftsmith.logs import configure_logging

    configure_logging()
    # Spawned here, not by torchrun: ranks without a process group (none is needed).
    results[rank] = extract_shards(*args, dist=Dist(rank, world, local_rank=rank))


def _run_spawned(world: int, args: tuple) -> list[dict[str, Any]]:
    """Run the ranks as child processes; this process reports their combined progress from
    the receipts on disk (the children's own progress never reaches this process's
    listeners, such as the Prefect progress artifact)."""
    import torch.multiprocessing as mp

    out, pending = args[3], args[4]
    manager = mp.get_context("spawn").Manager()
    results = manager.dict()
    context = mp.start_processes(_spawned_worker, args=(world, args, results), nprocs=world,
                                 start_method="spawn", join=False)
    progress = Progress(f"extract ({world} processes)", total=sum(s.num_tokens for s in pending),
                        unit="token")
    finished: set[str] = set()
    while True:
        stopped = context.join(timeout=2.0)
        for spec in pending:
            if spec.file not in finished and finished_shard(out, spec) is not None:
                finished.add(spec.file)
                progress.update(spec.num_tokens, shards=f"{len(finished)}/{len(pending)}",
                                free_disk=f"{free_disk_bytes(out) / 2**30:.1f} GiB")
        if stopped:
            break
    progress.close()
    return [results[r] for r in range(world)]


def prepare_output(plan: StagePlan) -> Path:
    """Unlike a stage that starts afresh, extract keeps what a crashed attempt finished."""
    if plan.is_complete():
        raise RuntimeError(f"{plan.dir} is already complete; refusing to overwrite it")
    plan.dir.mkdir(parents=True, exist_ok=True)
    removed = remove_partial_files(plan.dir)
    if removed:
        log.info("extract: removed %d partial file(s) of an interrupted attempt", removed)
    return plan.dir


def record_online_capture(cfg: ExtractConfig, merged: Descriptor, target: Descriptor,
                          plan: StagePlan) -> Descriptor:
    """train.mode: online: no store is written. The output records the capture the trainer
    runs itself (aux layer ids, store dtype), so the train stage's key covers it as it covers
    a store."""
    from draftsmith.extract.preflight import merged_tokens

    aux_ids = aux_layer_ids_for(cfg, target)
    prepare_output(plan)
    log.info("extract: skipped (train.mode: online); the trainer captures aux layers %s in %s "
             "from the target's prefill, nothing is stored", aux_ids, cfg.dtype)
    return finish_stage(
        plan,
        counts={"tokens": merged_tokens(merged), "shards": 0, "bytes": 0},
        figures={"aux_layer_ids": aux_ids, "dtype": cfg.dtype, "padding_waste": 0.0,
                 "mode": "online", "target_fingerprint": target.fingerprint},
    )


def run_extract(cfg: ExtractConfig, target_cfg: TargetConfig, merged: Descriptor,
                target: Descriptor, plan: StagePlan) -> Descriptor:
    aux_ids = aux_layer_ids_for(cfg, target)
    dist = Dist.from_env("gloo")  # under torchrun: the barriers need no GPU
    if dist.is_main:
        prepare_output(plan)
    dist.barrier()  # nobody writes before rank 0 has cleared partial files
    out = plan.dir
    rows = load_rows(merged)
    specs = shard_plan(rows, cfg.shard_tokens)
    pending = [s for s in specs if finished_shard(out, s) is None]
    if len(pending) < len(specs):
        log.info("extract: resuming, %d of %d shards already complete",
                 len(specs) - len(pending), len(specs))
    meta = _store_meta(cfg, target, aux_ids)
    if cfg.backend == "sglang":
        from draftsmith.extract.sglang_backend import run_sglang_capture

        reports = [run_sglang_capture(cfg, target_cfg, target, out, specs, rows, aux_ids)]
    elif cfg.backend == "vllm":
        from draftsmith.extract.vllm_backend import run_vllm_capture

        reports = [run_vllm_capture(cfg, target_cfg, target, out, specs, rows, aux_ids)]
    else:
        args = (cfg, target_cfg, target.path, out, pending, rows, aux_ids)
        if dist.world > 1:
            dist.barrier()  # every rank has its `pending` list before any rank writes a shard
            reports = [extract_shards(*args, dist=dist)]
            dist.barrier()
            if not dist.is_main:  # rank 0 writes the index; the others return its descriptor
                dist.barrier()
                return Descriptor.model_validate(
                    json.loads((plan.dir / "manifest.json").read_text())["descriptor"])
        elif cfg.data_parallel > 1:
            reports = _run_spawned(cfg.data_parallel, args)
        else:
            reports = [extract_shards(*args)]
    descriptor = _finish(plan, out, specs, meta, aux_ids, cfg,
                         (sum(r.get("real_tokens", 0) for r in reports),
                          sum(r.get("padded_tokens", 0) for r in reports)),
                         tokens_per_s=throughput(reports))
    dist.barrier()
    return descriptor


def throughput(reports: list[dict[str, Any]]) -> float | None:
    """Tokens a second of this attempt's capture: every rank's tokens over the slowest rank's
    seconds (the ranks run at once; loading the target is not counted). None when this
    attempt computed nothing: an earlier one wrote every shard."""
    tokens = sum(r.get("tokens", 0) for r in reports)
    seconds = max((r.get("seconds") or 0.0 for r in reports), default=0.0)
    return round(tokens / seconds, 1) if tokens and seconds > 0 else None


def _store_meta(cfg: ExtractConfig, target: Descriptor, aux_ids: list[int]) -> dict[str, Any]:
    return {"target_fingerprint": target.fingerprint, "aux_layer_ids": aux_ids,
            "hidden_size": TargetFigures.of(target).hidden_size, "dtype": cfg.dtype,
            "backend": cfg.backend, "layer_id_convention": LAYER_ID_CONVENTION}


def _finish(plan: StagePlan, out: Path, specs: list[ShardSpec], meta: dict[str, Any],
            aux_ids: list[int], cfg: ExtractConfig, padding: tuple[int, int],
            missing_hint: str = "a worker failed", tokens_per_s: float | None = None
            ) -> Descriptor:
    """The index of every shard (store.json) and the manifest, once every shard is written.
    padding: (real, padded) tokens of the forward passes. tokens_per_s: `throughput` (None
    where the shards were written elsewhere: each host's part reports its own)."""
    records = {s.file: finished_shard(out, s) for s in specs}
    missing = [name for name, r in records.items() if r is None]
    if missing:
        raise WorkerCrashError(f"extract: shards {missing[:5]} were not written ({missing_hint}); "
                               "run extract again to redo them")
    splits = {split: [records[s.file] for s in specs if s.split == split] for split in SPLITS}
    write_index(out, meta, splits)
    tokens = sum(s.num_tokens for s in specs)
    real, padded = padding
    log.info("extract: %d tokens in %d shards, aux layers %s (outputs of those decoder layers)",
             tokens, len(specs), aux_ids)
    return finish_stage(
        plan,
        counts={"tokens": tokens, "samples": sum(len(s.ids) for s in specs),
                "shards": len(specs), "bytes": sum(r["bytes"] for r in records.values())},
        figures={"aux_layer_ids": aux_ids, "dtype": cfg.dtype,
                 "padding_waste": round(1 - real / padded, 4) if padded else 0.0,
                 "tokens_per_s": tokens_per_s},
        known_checksums={name: r["sha256"] for name, r in records.items()},
    )


# --------------------------------------------------------------------------- several hosts


def range_shards(specs: list[ShardSpec], part: HostPart) -> list[ShardSpec]:
    """The part's contiguous range of the store's shards (in plan order, splits in turn)."""
    start, end = range_bounds(len(specs), part.count, part.index)
    return specs[start:end]


def run_extract_range(cfg: ExtractConfig, target_cfg: TargetConfig, merged: Descriptor,
                      target: Descriptor, plan: StagePlan, part: HostPart) -> dict[str, Any]:
    """One host's range of the shards, written into the shared stage directory beside the
    other hosts' (each shard with its receipt, as on one host); `join_extract` writes the
    index once every range is done. Shards of the range already receipted are kept."""
    aux_ids = aux_layer_ids_for(cfg, target)
    out = plan.dir
    out.mkdir(parents=True, exist_ok=True)
    rows = load_rows(merged)
    mine = range_shards(shard_plan(rows, cfg.shard_tokens), part)
    # Only this range's leftovers: the other hosts are writing theirs.
    for spec in mine:
        for leftover in (out / f".{spec.file}.tmp", out / RECEIPTS / f".{spec.file}.json.tmp"):
            leftover.unlink(missing_ok=True)
    pending = [s for s in mine if finished_shard(out, s) is None]
    log.info("extract %s: %d shards (%d tokens), %d already written", part.where(), len(mine),
             sum(s.num_tokens for s in mine), len(mine) - len(pending))
    args = (cfg, target_cfg, target.path, out, pending, rows, aux_ids)
    if cfg.data_parallel > 1 and len(pending) > 1:
        reports = _run_spawned(cfg.data_parallel, args)
    else:
        reports = [extract_shards(*args)]
    return {"shards": len(mine), "computed": len(pending),
            "tokens": sum(r.get("tokens", 0) for r in reports)}


def join_extract(cfg: ExtractConfig, merged: Descriptor, target: Descriptor,
                 plan: StagePlan) -> Descriptor:
    """Every range is written: the index and the manifest, the same bytes one host writes.
    The padding figure comes from the plan, which fixes every forward pass."""
    aux_ids = aux_layer_ids_for(cfg, target)
    rows = load_rows(merged)
    specs = shard_plan(rows, cfg.shard_tokens)
    real = padded = 0
    for spec in specs:
        batches = plan_batches(spec.tokens, cfg.batch_size, cfg.batch_tokens)
        real, padded = real + batches.real_tokens, padded + batches.padded_tokens
    return _finish(plan, plan.dir, specs, _store_meta(cfg, target, aux_ids), aux_ids, cfg,
                   (real, padded), missing_hint="a host's range did not finish")
