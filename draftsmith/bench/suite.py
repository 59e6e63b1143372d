"""The evaluation suite's figures: one row per prompt set and part (dev or test).

Each row holds the acceptance length over the set's prompts (tokens kept / verify rounds,
summed over prompts before dividing, as the engines count it), the share of rounds that
accepted a j-th draft, a 95% bootstrap interval over prompts, and how many outputs were
identical to greedy decoding. The interval resamples whole prompts (the unit that varies:
one prompt's rounds are not independent of each other), so it says how much the figure would
move on another draw of prompts like these.
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any

import numpy as np

from draftsmith.data.evalsets import EvalPrompt, part, suite_sets

if TYPE_CHECKING:
    from draftsmith.config import BenchmarkConfig

log = logging.getLogger(__name__)


def suite_prompts(suite: list, splits: list[str], per_set: int | None) -> list[EvalPrompt]:
    """The prompts measured: each set's parts in `splits` order, at most `per_set` each."""
    sets = suite_sets(suite)
    return [p for name in sets for split in splits for p in part(sets[name], split, per_set)]


def prompt_conversation(prompt: EvalPrompt) -> str:
    """The prompt's turns as the JSON that serve.deploy.prompt_ids reads."""
    return json.dumps(list(prompt.messages))


def bootstrap_interval(tokens: list[int], rounds: list[int], samples: int, seed: int = 0,
                       level: float = 0.95) -> list[float]:
    """[low, high] of sum(tokens) / sum(rounds) over prompts drawn with replacement."""
    kept = np.asarray(tokens, dtype=np.float64)  # [P]
    verifies = np.asarray(rounds, dtype=np.float64)  # [P]
    if len(kept) == 0:
        return [float("nan"), float("nan")]
    draws = np.random.default_rng(seed).integers(0, len(kept), size=(samples, len(kept)))  # [S, P]
    ratios = kept[draws].sum(1) / np.maximum(verifies[draws].sum(1), 1)  # [S]
    tail = (1 - level) / 2
    low, high = np.quantile(ratios, [tail, 1 - tail])
    return [round(float(low), 4), round(float(high), 4)]


def set_rows(prompts: list[EvalPrompt], per_prompt: list[dict[str, Any]], num_steps: int,
             samples: int) -> list[dict[str, Any]]:
    """One row per (set, part), in the order the prompts were measured. per_prompt: the
    engine's rows for the same prompts (verify_rounds, round_tokens, accepted_by_position,
    identical; speculative_s, greedy_s and their tokens when timed)."""
    groups: dict[tuple[str, str], list[int]] = {}
    for i, prompt in enumerate(prompts):
        groups.setdefault((prompt.set, prompt.split), []).append(i)
    rows = []
    for (name, split), members in groups.items():
        chosen = [per_prompt[i] for i in members]
        rounds = sum(p["verify_rounds"] for p in chosen)
        tokens = sum(p["round_tokens"] for p in chosen)
        accepted = [sum(p["accepted_by_position"][j] for p in chosen) for j in range(num_steps)]
        same = [p["identical"] for p in chosen if p.get("identical") is not None]
        row: dict[str, Any] = {
            "set": name, "split": split, "prompts": len(chosen),
            "acceptance": round(tokens / max(rounds, 1), 4),
            "ci95": bootstrap_interval([p["round_tokens"] for p in chosen],
                                       [p["verify_rounds"] for p in chosen], samples),
            "per_position": [round(a / max(rounds, 1), 4) for a in accepted],
            "identical": f"{sum(same)}/{len(same)}" if same else None,
            "lossless": all(same) if same else None,
            "completion_tokens": sum(p["completion_tokens"] for p in chosen),
            "verify_rounds": rounds, "round_tokens": tokens,
        }
        if all("speculative_s" in p and "greedy_s" in p for p in chosen):
            spec = sum(p["completion_tokens"] for p in chosen) / sum(p["speculative_s"]
                                                                   for p in chosen)
            plain = sum(p["plain_tokens"] for p in chosen) / sum(p["greedy_s"] for p in chosen)
            row["speedup"] = round(spec / plain, 3)
        rows.append(row)
    return rows


def sets_markdown(rows: list[dict[str, Any]]) -> str:
    """The per-set table of a benchmark report."""
    lines = ["| set | part | prompts | acceptance | 95% interval | per position | identical "
             "| speedup |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        low, high = r["ci95"]
        lines.append(f"| {r['set']} | {r['split']} | {r['prompts']} | {r['acceptance']:.3f} | "
                     f"{low:.3f}-{high:.3f} | {', '.join(f'{a:.2f}' for a in r['per_position'])}"
                     f" | {r['identical'] or '-'} | {r.get('speedup', '-')} |")
    return "\n".join(lines) + "\n"


def with_sets(cfg: BenchmarkConfig, suite: list[EvalPrompt] | None, per_prompt: list[dict],
              num_steps: int) -> list[dict]:
    """The suite's rows (one per set and part), each prompt's row labelled with its set."""
    if not suite:
        return []
    for prompt, row in zip(suite, per_prompt, strict=True):
        row.update(set=prompt.set, split=prompt.split, id=prompt.id)
    rows = set_rows(suite, per_prompt, num_steps, cfg.bootstrap_samples)
    for row in rows:
        log.info("benchmark %s (%s, %d prompts): acceptance %.3f [%.3f, %.3f], per position "
                 "%s, identical %s", row["set"], row["split"], row["prompts"],
                 row["acceptance"], *row["ci95"], row["per_position"], row["identical"])
    return rows
