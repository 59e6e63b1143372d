"""Stage `merge`: combine sources, deduplicate, shuffle, split, tokenise, build the draft vocab."""

from __future__ import annotations

import hashlib
import json
import logging
import random
from collections import defaultdict
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from safetensors.torch import load_file, save_file

from draftsmith.artifacts import Descriptor, StagePlan, finish_stage, hash_json, stage_output
from draftsmith.config import MergeConfig
from draftsmith.data.tokenize import tokenize_record
from draftsmith.data.vocab import build_vocab_map
from draftsmith.generate.stage import read_records
from draftsmith.target import load_tokenizer

log = logging.getLogger(__name__)

SPLITS = ("train", "validation")
VOCAB_FILE = "vocab_map.safetensors"


def is_validation(record_id: str, fraction: float) -> bool:
    """Split by a hash of the id, so adding data never moves a record between splits."""
    bucket = int(hashlib.sha256(record_id.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
    return bucket < fraction


def run_merge(cfg: MergeConfig, generated: Descriptor, target: Descriptor,
              plan: StagePlan) -> Descriptor:
    records = read_records(generated)
    if cfg.dedup:
        seen: set[str] = set()
        unique = []
        for r in records:
            digest = hash_json([m.model_dump() for m in r.messages])
            if digest not in seen:
                seen.add(digest)
                unique.append(r)
        log.info("merge: %d duplicates removed", len(records) - len(unique))
        records = unique
    random.Random(cfg.seed).shuffle(records)

    tokenizer = load_tokenizer(target)
    rows: dict[str, list[dict]] = {split: [] for split in SPLITS}
    per_source: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for record in records:
        ids, mask = tokenize_record(tokenizer, record)
        source = per_source[record.source]
        if len(ids) > cfg.max_length:
            ids, mask = ids[: cfg.max_length], mask[: cfg.max_length]
            source["truncated"] += 1
        if not any(mask):
            source["no_assistant_tokens"] += 1
            continue
        split = "validation" if is_validation(record.id, cfg.validation_fraction) else "train"
        rows[split].append({"id": record.id, "source": record.source,
                            "messages": json.dumps([m.model_dump(exclude_none=True)
                                                    for m in record.messages]),
                            "input_ids": ids, "loss_mask": mask})
        source[f"{split}_records"] += 1
        source["tokens"] += len(ids)
        source["masked_tokens"] += sum(mask)
    if not rows["train"]:
        raise ValueError(f"merge: no training records left out of {len(records)}; see per-source "
                         f"counts {json.loads(json.dumps(per_source))}")

    masked_ids = (t for row in rows["train"]
                  for t, m in zip(row["input_ids"], row["loss_mask"], strict=True) if m)
    # The model's vocab (not the tokenizer's length: configs often round it up) sizes t2d.
    model_vocab = target.figures["vocab_size"]
    d2t, t2d, coverage = build_vocab_map(masked_ids, model_vocab, cfg.draft_vocab_size)

    with stage_output(plan) as out:
        for split in SPLITS:
            pq.write_table(pa.Table.from_pylist(rows[split]), out / f"{split}.parquet")
        save_file({"d2t": d2t, "t2d": t2d}, str(out / VOCAB_FILE))
        stats = {s: dict(c) for s, c in per_source.items()}
        (out / "stats.json").write_text(json.dumps(stats, indent=2, sort_keys=True))
    for name, c in sorted(per_source.items()):
        log.info("merge: source %s: %s", name, dict(c))
    log.info("merge: draft vocab %d of %d ids covers %.1f%% of assistant tokens",
             cfg.draft_vocab_size, model_vocab, 100 * coverage)
    return finish_stage(
        plan,
        counts={
            "train_records": len(rows["train"]),
            "validation_records": len(rows["validation"]),
            "train_tokens": sum(len(r["input_ids"]) for r in rows["train"]),
            "train_masked_tokens": sum(sum(r["loss_mask"]) for r in rows["train"]),
        },
        figures={"draft_vocab_coverage": round(coverage, 4),
                 "draft_vocab_size": cfg.draft_vocab_size},
    )


def read_split(merged: Descriptor, split: str) -> list[dict]:
    return pq.read_table(Path(merged.path) / f"{split}.parquet").to_pylist()


def read_vocab_map(merged: Descriptor):
    tensors = load_file(str(Path(merged.path) / VOCAB_FILE))
    return tensors["d2t"], tensors["t2d"]
