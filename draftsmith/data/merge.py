"""Stage `merge`: combine sources, deduplicate, shuffle, split, tokenise, build the draft vocab."""

from __future__ import annotations

import hashlib
import json
import logging
import random
import unicodedata
from collections import defaultdict
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from safetensors.torch import load_file, save_file

from draftsmith.artifacts import Descriptor, StagePlan, finish_stage, hash_json, stage_output
from draftsmith.config import MergeConfig
from draftsmith.data.evalsets import EvalPrompt
from draftsmith.data.formats import DataFormatError, Record
from draftsmith.data.overlap import CHECKS, Prompt, check_overlap, decontaminate
from draftsmith.data.records import read_records
from draftsmith.data.tokenize import check_special_tokens, pool_workers, tokenize_records
from draftsmith.data.vocab import build_vocab_map
from draftsmith.figures import MERGE_COVERAGE_FILE, TargetFigures
from draftsmith.target import load_tokenizer

log = logging.getLogger(__name__)

SPLITS = ("train", "validation")
VOCAB_FILE = "vocab_map.safetensors"
COVERAGE_FILE = MERGE_COVERAGE_FILE
CHECKS_FILE = "checks.json"
OVERLAP_FILE = "benchmark_overlap.json"
DECONTAMINATION_FILE = "decontamination.json"


def is_validation(record_id: str, fraction: float) -> bool:
    """Split by a hash of the id, so adding data never moves a record between splits."""
    bucket = int(hashlib.sha256(record_id.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
    return bucket < fraction


def _normalised_text(record: Record) -> str:
    """Case, whitespace and punctuation folded: near-exact copies (a re-scraped page, a trailing
    space, "Hello!" vs "hello") get one key."""
    parts = []
    for m in record.messages:
        text = "".join(ch for ch in m.content.lower() if not unicodedata.category(ch)
                       .startswith("P"))
        parts.append(m.role + ":" + " ".join(text.split()))
    return "\n".join(parts)


def deduplicate(records: list[Record], exact: bool, near: bool
                ) -> tuple[list[Record], dict[str, dict[str, int]]]:
    """Keep the first of each group of duplicates; counts per source of what went, and why."""
    removed: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    seen_exact: set[str] = set()
    seen_near: set[str] = set()
    unique = []
    for r in records:
        if exact:
            digest = hash_json([m.model_dump() for m in r.messages])
            if digest in seen_exact:
                removed[r.source]["exact_duplicates"] += 1
                continue
            seen_exact.add(digest)
        if near:
            digest = hashlib.sha256(_normalised_text(r).encode()).hexdigest()
            if digest in seen_near:
                removed[r.source]["near_duplicates"] += 1
                continue
            seen_near.add(digest)
        unique.append(r)
    return unique, removed


def _coverage(rows: dict[str, list[dict]], t2d) -> dict[tuple[str, str], tuple[int, int]]:
    """(source, split) -> (loss-masked tokens inside the draft vocab, loss-masked tokens)."""
    in_vocab = t2d.tolist()
    counts: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
    for split, split_rows in rows.items():
        for row in split_rows:
            c = counts[(row["source"], split)]
            for token, bit in zip(row["input_ids"], row["loss_mask"], strict=True):
                if bit:
                    c[0] += in_vocab[token]
                    c[1] += 1
    return {k: (v[0], v[1]) for k, v in counts.items()}


def _share(pairs) -> float:
    pairs = list(pairs)
    total = sum(t for _, t in pairs)
    return sum(i for i, _ in pairs) / total if total else 0.0


def run_merge(cfg: MergeConfig, generated: Descriptor, target: Descriptor,
              plan: StagePlan, benchmark: tuple[str, list[Prompt]] | None = None,
              eval_sets: dict[str, list[EvalPrompt]] | None = None) -> Descriptor:
    """benchmark: (name, prompts) of the benchmark's own prompt set; no record may overlap it
    (draftsmith/data/overlap.py), or the stage fails naming the records. eval_sets: the
    evaluation suite's sets (every prompt, both parts); records that resemble one are dropped
    or fail the stage (merge.decontaminate), with a report per set."""
    records = read_records(generated)
    read_per_source: dict[str, int] = defaultdict(int)
    for r in records:
        read_per_source[r.source] += 1
    records, removed = deduplicate(records, cfg.dedup, cfg.dedup and cfg.near_dedup)
    log.info("merge: %d exact and %d near-exact duplicates removed",
             sum(c.get("exact_duplicates", 0) for c in removed.values()),
             sum(c.get("near_duplicates", 0) for c in removed.values()))
    contamination = None
    if eval_sets:
        before = records
        records, contamination = decontaminate(records, eval_sets, cfg.decontaminate)
        kept_ids = {r.id for r in records}
        for r in before:
            if r.id not in kept_ids:
                removed.setdefault(r.source, defaultdict(int))["decontaminated"] += 1
        for report in contamination:
            log.info("merge: against the evaluation set %s (%d prompts): %d records flagged "
                     "(%s)", report["set"], report["eval_prompts"], report["records_flagged"],
                     ", ".join(f"{c} {report[c]}" for c in CHECKS))
    overlap = None
    if benchmark is not None:
        overlap = check_overlap(records, benchmark[1], benchmark[0], cfg.max_benchmark_overlap)
        log.info("merge: no overlap with the benchmark %s: %d records against %d benchmark "
                 "prompts, 0 exact and 0 near matches (largest similarity %.3f, limit %s)",
                 benchmark[0], overlap["records_checked"], overlap["benchmark_prompts"],
                 overlap["max_similarity"], cfg.max_benchmark_overlap)
    random.Random(cfg.seed).shuffle(records)

    tokenizer = load_tokenizer(target)
    special = check_special_tokens(tokenizer, target.path)
    if not special["stops_generation"]:
        log.warning("merge: the chat template ends assistant turns with %s (id %d) but "
                    "generation stops on ids %s: answers generated with this tokenizer may "
                    "never end their turn", special["end_of_turn_token"],
                    special["end_of_turn_id"], special["generation_stop_ids"])
    rows: dict[str, list[dict]] = {split: [] for split in SPLITS}
    per_source: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for name, count in read_per_source.items():
        per_source[name]["read"] = count
        per_source[name].update(removed.get(name, {}))
    workers = pool_workers(len(records))
    if workers:
        log.info("merge: tokenising %d records over %d processes", len(records), workers)
    for record, (ids, mask) in zip(records, tokenize_records(tokenizer, records, workers),
                                   strict=True):
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
        source["records"] += 1
        source["tokens"] += len(ids)
        source["masked_tokens"] += sum(mask)
    if not rows["train"]:
        raise DataFormatError(f"merge: no training records left out of {len(records)}; see "
                              f"per-source counts {json.loads(json.dumps(per_source))}")

    masked_ids = (t for row in rows["train"]
                  for t, m in zip(row["input_ids"], row["loss_mask"], strict=True) if m)
    # The model's vocab (not the tokenizer's length: configs often round it up) sizes t2d.
    model_vocab = TargetFigures.of(target).vocab_size
    d2t, t2d, coverage = build_vocab_map(masked_ids, model_vocab, cfg.draft_vocab_size)
    covered = _coverage(rows, t2d)
    validation_coverage = _share(v for (_, split), v in covered.items() if split == "validation")
    stats = {}
    for name, c in sorted(per_source.items()):
        c = dict(c)
        c["mean_length"] = round(c.get("tokens", 0) / c["records"], 1) if c.get("records") else 0
        c["draft_vocab_coverage"] = round(_share(v for (s, _), v in covered.items()
                                                 if s == name), 4)
        stats[name] = c
    vocab_report = {
        "draft_vocab_size": cfg.draft_vocab_size, "target_vocab_size": model_vocab,
        "train_masked_tokens": sum(t for (_, sp), (_, t) in covered.items() if sp == "train"),
        "coverage_train": round(coverage, 6),
        "validation_masked_tokens": sum(t for (_, sp), (_, t) in covered.items()
                                        if sp == "validation"),
        "coverage_validation": round(validation_coverage, 6),
        "coverage_per_source": {name: c["draft_vocab_coverage"] for name, c in stats.items()},
    }

    with stage_output(plan) as out:
        for split in SPLITS:
            pq.write_table(pa.Table.from_pylist(rows[split]), out / f"{split}.parquet")
        save_file({"d2t": d2t, "t2d": t2d}, str(out / VOCAB_FILE))
        (out / "stats.json").write_text(json.dumps(stats, indent=2, sort_keys=True))
        (out / COVERAGE_FILE).write_text(json.dumps(vocab_report, indent=2))
        (out / CHECKS_FILE).write_text(json.dumps({"special_tokens": special}, indent=2))
        if overlap is not None:
            (out / OVERLAP_FILE).write_text(json.dumps(overlap, indent=2))
        if contamination is not None:
            (out / DECONTAMINATION_FILE).write_text(json.dumps(contamination, indent=2))
    for name, c in stats.items():
        log.info("merge: source %s: %s", name, c)
    log.info("merge: draft vocab %d of %d ids covers %.1f%% of train and %.1f%% of validation "
             "assistant tokens", cfg.draft_vocab_size, model_vocab, 100 * coverage,
             100 * validation_coverage)
    return finish_stage(
        plan,
        counts={
            "train_records": len(rows["train"]),
            "validation_records": len(rows["validation"]),
            "train_tokens": sum(len(r["input_ids"]) for r in rows["train"]),
            "validation_tokens": sum(len(r["input_ids"]) for r in rows["validation"]),
            "train_masked_tokens": sum(sum(r["loss_mask"]) for r in rows["train"]),
            "truncated": sum(c.get("truncated", 0) for c in stats.values()),
            "exact_duplicates": sum(c.get("exact_duplicates", 0) for c in stats.values()),
            "near_duplicates": sum(c.get("near_duplicates", 0) for c in stats.values()),
            "decontaminated": sum(c.get("decontaminated", 0) for c in stats.values()),
        },
        figures={"draft_vocab_coverage": round(coverage, 4),
                 "draft_vocab_coverage_validation": round(validation_coverage, 4),
                 "draft_vocab_size": cfg.draft_vocab_size,
                 "end_of_turn_token": special["end_of_turn_token"],
                 **({"benchmark_overlap": {k: overlap[k] for k in (
                     "benchmark", "benchmark_prompts", "records_checked", "exact_matches",
                     "near_matches", "max_similarity")}} if overlap is not None else {}),
                 **({"decontamination": [{k: r[k] for k in (
                     "set", "eval_prompts", "records_flagged", *CHECKS)}
                     for r in contamination]} if contamination is not None else {})},
    )


def read_split(merged: Descriptor, split: str) -> list[dict]:
    return pq.read_table(Path(merged.path) / f"{split}.parquet").to_pylist()


def read_vocab_map(merged: Descriptor):
    tensors = load_file(str(Path(merged.path) / VOCAB_FILE))
    return tensors["d2t"], tensors["t2d"]
