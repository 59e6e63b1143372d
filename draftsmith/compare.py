"""Comparing configs: several variants of one pipeline config, run one after the other on one
run root, and one table of their figures.

A variant is a name and `key=value` overrides over the base config (the same overrides as
`draftsmith run --set`): `dflash: drafter.kind=dflash`, `e2: train.epochs=2`,
`small: data.sources=[...]`. Each variant runs the whole pipeline as any run does, so the stages
its settings leave unchanged are Cached from an earlier variant (variants that differ in
training share generate and merge). Each variant's own reports are published under its own
pipeline name (`<name>-<variant>`), and the comparison under the base name.

The table has one row per variant: its overrides, the stages it ran, the training figures
(tau, the replayed acceptance) and the benchmark's, one column per evaluation set and part
(`chat dev`: acceptance and its 95% interval) when the benchmark runs a suite, and what the
variant's outputs took to make: each stage's seconds, the highest GPU peak and the megabytes
on disk (draftsmith/stage_cost.py), and the target's answering and capture rates
(tokens/s). Decide on the dev parts (`--set benchmark.splits=[dev]`),
then report the chosen variant's test parts.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from draftsmith.artifacts import atomic_write_json
from draftsmith.config import ConfigError, slug
from draftsmith.stage_cost import StageCost

COMPARE_DIR = "compare"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


@dataclass(frozen=True)
class Variant:
    name: str
    overrides: tuple[str, ...] = ()

    def run_overrides(self, base_name: str) -> list[str]:
        """The variant's overrides, and its own pipeline name for its reports."""
        return [*self.overrides, f"name={base_name}-{self.name}"]


def parse_variant(text: str) -> Variant:
    """`NAME: key=value key=value` (or `NAME` alone, the base config as it is)."""
    name, _, rest = text.partition(":")
    name = name.strip()
    if not _NAME.match(name):
        raise ConfigError(f"--variant {text!r}: start with the variant's name (letters, digits, "
                          "., _ or -), then a colon and its overrides, e.g. "
                          "--variant 'e2: train.epochs=2 train.lr=1e-3'")
    try:
        overrides = tuple(shlex.split(rest))
    except ValueError as err:
        raise ConfigError(f"--variant {text!r}: {err} (quote an override whose value has "
                          "spaces: 'data.sources=[{name: a, path: a.jsonl}]')") from None
    bad = [o for o in overrides if "=" not in o]
    if bad:
        raise ConfigError(f"--variant {text!r}: {bad} are not key=value overrides, e.g. "
                          "train.epochs=2 (quote an override whose value has spaces)")
    return Variant(name, overrides)


def check_variants(variants: list[Variant]) -> None:
    if not variants:
        raise ConfigError("compare: give at least one variant (--variant NAME: key=value ...)")
    names = [v.name for v in variants]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ConfigError(f"compare: variant names {repeated} given more than once; name each "
                          "variant once")


def _figure(results: dict[str, dict], stage: str) -> dict[str, Any]:
    entry = results.get(stage) or {}
    descriptor = entry.get("descriptor") or {}
    return {**descriptor.get("counts", {}), **descriptor.get("figures", {})}


def comparison_row(variant: Variant, results: dict[str, dict]) -> dict[str, Any]:
    """One variant's row: its settings, what ran, and its training and benchmark figures."""
    train, bench = _figure(results, "train"), _figure(results, "benchmark")
    merge = _figure(results, "merge")
    row: dict[str, Any] = {
        "variant": variant.name, "overrides": " ".join(variant.overrides) or "-",
        "ran": ", ".join(s for s, r in results.items() if r.get("state") == "Completed") or "-",
        "train records": merge.get("train_records"),
        "tau": _rounded(train.get("tau")),
        "replayed": _rounded(train.get("acceptance_replayed")),
        "train tokens/s": _rounded(train.get("tokens_per_s")),
    }
    sets = bench.get("sets") or []
    for entry in sets:
        low, high = entry["ci95"]
        row[f"{entry['set']} {entry['split']}"] = (f"{entry['acceptance']:.3f} "
                                                   f"[{low:.3f}, {high:.3f}]")
    if not sets:
        row["acceptance"] = _rounded(bench.get("acceptance_length"))
    row["identical"] = _identical(bench, sets)
    row["speedup"] = _rounded(bench.get("speedup"))
    row.update(_speeds(results))
    row.update(_costs(results))
    row["drafter"] = _figure(results, "export").get("drafter_dir")  # the one to deploy
    return row


def _speeds(results: dict[str, dict]) -> dict[str, Any]:
    """How fast the target answered and was captured, for comparing those stages' settings
    (`--to generate`, `--to extract`). Answers are kept across the settings that only decide
    their speed (generate.batch_size, generate.cache), so a variant that asked the target
    nothing says `reused`, not a rate; to time each, give each its own run_root."""
    generate, extract = _figure(results, "generate"), _figure(results, "extract")
    reused = "reused" if generate and generate.get("backend") else None
    return {"generate tokens/s": _rounded(generate.get("tokens_per_s")) or reused,
            "extract tokens/s": _rounded(extract.get("tokens_per_s"))}


def _costs(results: dict[str, dict]) -> dict[str, Any]:
    """What the variant's outputs took to make (a Cached one's as its first run made it):
    each measured stage's seconds, the highest GPU peak, and the bytes its outputs hold."""
    costs = {stage: StageCost.model_validate(cost) for stage, entry in results.items()
             if (cost := (entry.get("descriptor") or {}).get("cost")) is not None}
    row: dict[str, Any] = {f"{stage} s": cost.seconds for stage, cost in costs.items()
                           if cost.seconds is not None}
    peaks = [cost.peak_gpu_gib for cost in costs.values() if cost.peak_gpu_gib is not None]
    row["GPU peak GiB"] = max(peaks) if peaks else None
    row["disk MB"] = (round(sum(cost.disk_bytes for cost in costs.values()) / 1e6, 1)
                      if costs else None)
    return row


def _identical(bench: dict[str, Any], sets: list[dict[str, Any]]) -> str | None:
    counts = [s["identical"] for s in sets if s.get("identical")]
    if counts:
        same = sum(int(c.split("/")[0]) for c in counts)
        return f"{same}/{sum(int(c.split('/')[1]) for c in counts)}"
    return bench.get("identical_outputs")


def _rounded(value: Any) -> Any:
    return round(value, 3) if isinstance(value, float) else value


def shown_columns(rows: list[dict[str, Any]]) -> list[str]:
    """The columns a table shows: those with a value in some row (a comparison stopped after
    training has no benchmark columns to show; the rows on disk keep every key)."""
    return [c for c in dict.fromkeys(k for row in rows for k in row)
            if any(row.get(c) is not None for row in rows)]


def comparison_markdown(title: str, rows: list[dict[str, Any]]) -> str:
    columns = shown_columns(rows)
    lines = [f"# {title}", "", "| " + " | ".join(columns) + " |",
             "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join("-" if row.get(c) is None else str(row[c]) for c in columns)
              + " |" for row in rows]
    return "\n".join(lines) + "\n"


def write_comparison(run_root: str | Path, name: str, rows: list[dict[str, Any]],
                     variants: list[Variant]) -> Path:
    """`<run_root>/compare/<name>.json`: the rows and each variant's overrides."""
    path = comparison_path(run_root, name)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, {"rows": rows, "variants": [
        {"name": v.name, "overrides": list(v.overrides)} for v in variants]})
    return path


def comparison_path(run_root: str | Path, name: str) -> Path:
    """Where the comparison of the pipeline `name` is written under its run root."""
    return Path(run_root) / COMPARE_DIR / f"{slug(name)}.json"


def read_comparison(path: str | Path) -> dict[str, Any]:
    return json.loads(Path(path).read_text())
