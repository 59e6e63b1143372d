"""Proof that no training prompt is a benchmark prompt: an exact and a near-duplicate check.

A drafter measured on prompts it was trained on reports an acceptance no user will see. When the
benchmark has prompts of its own (benchmark.prompts_builtin, benchmark.prompts_file), the merge
stage compares every record's prompt (its non-assistant turns) with every benchmark prompt:

- exact: the same text once case and whitespace are folded;
- near: token 8-grams (words and punctuation, lower-cased) shared with a benchmark prompt, as a
  share of the smaller of the two prompts' n-grams (so a training prompt that embeds a benchmark
  prompt, or one with a renamed variable, scores high). N-grams that many prompts share (an
  instruction both sets are asked with, `from typing import List`) say nothing about overlap
  and are left out.

Any pair at or above `merge.max_benchmark_overlap` fails the stage, naming the records.
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Any

from draftsmith.data.formats import Record, load_source
from draftsmith.errors import InputError

NGRAM = 8
# An n-gram in more than this share of either set's prompts (and in more than 2) is template.
COMMON_SHARE = 0.05
_TOKEN = re.compile(r"\w+|[^\w\s]")


class OverlapError(InputError, ValueError):
    """Training data that overlaps the benchmark; the message names the records and the fix."""


@dataclass(frozen=True)
class Prompt:
    id: str
    source: str
    text: str


def prompt_text(record: Record) -> str:
    """What a record asks: every turn but the assistant's."""
    return "\n".join(m.content for m in record.messages if m.role != "assistant")


def _folded(text: str) -> str:
    return " ".join(text.lower().split())


def _ngrams(text: str, n: int = NGRAM) -> set[tuple[str, ...]]:
    tokens = _TOKEN.findall(text.lower())
    if len(tokens) < n:
        return {tuple(tokens)} if tokens else set()
    return {tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)}


def _common(sets: list[set], share: float) -> set:
    counts: Counter = Counter(g for s in sets for g in s)
    limit = max(2, share * len(sets))
    return {g for g, c in counts.items() if c > limit}


def _similarities(train: list[Prompt], benchmark: list[Prompt]
                  ) -> tuple[list[dict[str, Any]], list[tuple[float, int, int]]]:
    """(the exact copies, every near pair as (similarity, train index, benchmark index), the
    most similar first)."""
    bench_exact = defaultdict(list)
    for b in benchmark:
        bench_exact[_folded(b.text)].append(b.id)
    exact = [{"record": p.id, "source": p.source, "benchmark": ids[0]}
             for p in train if (ids := bench_exact.get(_folded(p.text)))]

    train_grams = [_ngrams(p.text) for p in train]
    bench_grams = [_ngrams(b.text) for b in benchmark]
    common = _common(train_grams, COMMON_SHARE) | _common(bench_grams, COMMON_SHARE)
    bench_grams = [g - common for g in bench_grams]
    index: dict[tuple[str, ...], list[int]] = defaultdict(list)
    for j, grams in enumerate(bench_grams):
        for g in grams:
            index[g].append(j)
    best: list[tuple[float, int, int]] = []
    for i, grams in enumerate(train_grams):
        grams = grams - common
        shared: Counter[int] = Counter(j for g in grams for j in index.get(g, ()))
        for j, count in shared.items():
            smaller = min(len(grams), len(bench_grams[j])) or 1
            best.append((count / smaller, i, j))
    best.sort(reverse=True)
    return exact, best


def similar_records(records: list[Record], benchmark: list[Prompt], max_similarity: float
                    ) -> dict[str, str]:
    """record id -> the benchmark prompt it copies or resembles (similarity at least
    `max_similarity`), for a source that drops such records rather than failing the merge."""
    train = [Prompt(r.id, r.source, prompt_text(r)) for r in records]
    exact, best = _similarities(train, benchmark)
    found = {e["record"]: e["benchmark"] for e in exact}
    for score, i, j in best:
        if score >= max_similarity:
            found.setdefault(train[i].id, benchmark[j].id)
    return found


def check_overlap(records: list[Record], benchmark: list[Prompt], benchmark_name: str,
                  max_similarity: float, top: int = 5) -> dict[str, Any]:
    """The report (exact and near pairs, the closest pairs, the largest similarity); raises
    OverlapError when a pair is exact or at least `max_similarity`."""
    train = [Prompt(r.id, r.source, prompt_text(r)) for r in records]
    exact, best = _similarities(train, benchmark)

    def pair(score: float, i: int, j: int) -> dict[str, Any]:
        return {"record": train[i].id, "source": train[i].source,
                "benchmark": benchmark[j].id, "similarity": round(score, 4)}

    exact_ids = {e["record"] for e in exact}  # an exact copy is not counted again as near
    near = [pair(*b) for b in best if b[0] >= max_similarity and train[b[1]].id not in exact_ids]
    report = {
        "benchmark": benchmark_name,
        "benchmark_prompts": len(benchmark),
        "records_checked": len(train),
        "ngram": NGRAM,
        "exact_matches": len(exact),
        "near_matches": len(near),
        "max_similarity": round(best[0][0], 4) if best else 0.0,
        "closest": [pair(*b) for b in best[:top]],
        "exact": exact[:50],
        "near": near[:50],
    }
    if exact or near:
        shown = "; ".join(f"{e['record']} ({e['source']}) = {e['benchmark']}" for e in exact[:3])
        shown += ("; " if exact and near else "") + "; ".join(
            f"{n['record']} ({n['source']}) ~ {n['benchmark']} ({n['similarity']:.2f})"
            for n in near[:3])
        raise OverlapError(
            f"merge: the training data overlaps the benchmark {benchmark_name}: "
            f"{len(exact)} exact and {len(near)} near matches (similarity >= "
            f"merge.max_benchmark_overlap={max_similarity}) among {len(train)} records, e.g. "
            f"{shown}. A drafter trained on benchmark prompts reports an acceptance users will "
            "not see: remove those records from their sources, or benchmark on other prompts")
    return report


def benchmark_prompt_set(prompts_builtin: str | None, prompts_file: str | None
                         ) -> tuple[str, list[Prompt]] | None:
    """(name, every prompt) of the benchmark's own prompt set, or None when it benchmarks on
    the validation split (disjoint from training by construction)."""
    if prompts_builtin:
        records, _ = load_source(prompts_builtin, builtin=prompts_builtin)
        name = f"builtin:{prompts_builtin}"
    elif prompts_file:
        records, _ = load_source("benchmark", prompts_file)
        name = prompts_file
    else:
        return None
    return name, [Prompt(r.id, r.source, prompt_text(r)) for r in records]


def benchmark_fingerprint(prompts_builtin: str | None, prompts_file: str | None) -> str | None:
    """The content hash of the benchmark's own prompt set (None: the validation split)."""
    if prompts_builtin:
        from draftsmith.data.packaged import builtin_fingerprint

        return builtin_fingerprint(prompts_builtin)
    if prompts_file:
        from draftsmith.fingerprints import file_fingerprint

        return file_fingerprint("benchmark.prompts_file", prompts_file)
    return None


# --------------------------------------------------------------------------- decontamination


CONTAMINATION_NGRAM = 13
_DEFINED = re.compile(r"\bdef\s+([A-Za-z_]\w*)\s*\(")
_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])")


def normalized_name(name: str) -> str:
    """A function name with case, underscores and camelCase folded: `has_close_elements`,
    `hasCloseElements` and `HasCloseElements` are one name."""
    return re.sub(r"[^a-z0-9]", "", _CAMEL.sub("_", name).lower())


def defined_names(text: str) -> set[str]:
    """The normalized names of the Python functions a text defines."""
    return {normalized_name(n) for n in _DEFINED.findall(text)}


# A run of digits and punctuation (`[1, 2, 3, 4, 5, 6, 7]`) identifies no prompt: an n-gram
# counts only with this many tokens that hold a letter.
MIN_WORDS_PER_NGRAM = 4


def _gram_hashes(text: str, n: int = CONTAMINATION_NGRAM) -> set[int]:
    tokens = _TOKEN.findall(text.lower())
    wordy = [any(c.isalpha() for c in t) for t in tokens]
    return {hash(tuple(tokens[i:i + n])) for i in range(len(tokens) - n + 1)
            if sum(wordy[i:i + n]) >= MIN_WORDS_PER_NGRAM}


def _token_line(text: str) -> str:
    """The text's tokens, space-separated and space-framed: a run of them is a substring."""
    return " " + " ".join(_TOKEN.findall(text.lower())) + " "


@dataclass
class EvalIndex:
    """What one evaluation set's prompts are recognised by: their folded text, their 13-grams
    (and their reference answers' ones) and their entry points' normalized names. N-grams in
    more than COMMON_SHARE of the set's prompts are its template (HumanEval's instruction,
    which the python-functions prompts share) and say nothing about one prompt."""

    name: str
    size: int
    exact: dict[str, str]  # folded prompt text -> prompt id
    grams: dict[int, str]  # n-gram hash -> a prompt id
    names: dict[str, str]  # normalized entry-point name -> prompt id
    short: list[tuple[str, str]]  # (token line, id) of prompts too short for one n-gram

    @classmethod
    def of(cls, name: str, prompts: list) -> EvalIndex:
        per_prompt = [_gram_hashes(p.text) | (_gram_hashes(p.reference) if p.reference else
                                              set()) for p in prompts]
        common = _common(per_prompt, COMMON_SHARE)
        grams: dict[int, str] = {}
        for prompt, hashes in zip(prompts, per_prompt, strict=True):
            for h in hashes - common:
                grams.setdefault(h, prompt.id)
        short = [(_token_line(p.text), p.id) for p in prompts
                 if len(_TOKEN.findall(p.text)) < CONTAMINATION_NGRAM]
        return cls(name, len(prompts), {_folded(p.text): p.id for p in prompts}, grams,
                   {normalized_name(p.entry_point): p.id for p in prompts if p.entry_point},
                   short)


CHECKS = ("prompt_exact", "prompt_ngram", "answer_ngram", "entry_point_name")


def _hits(record: Record, index: EvalIndex, prompt_grams: set[int], answer_grams: set[int],
          names: set[str]) -> dict[str, str]:
    """check -> the evaluation prompt it matched, for each check the record fails."""
    hits: dict[str, str] = {}
    exact = index.exact.get(_folded(prompt_text(record)))
    if exact:
        hits["prompt_exact"] = exact
    shared = next((index.grams[g] for g in prompt_grams if g in index.grams), None)
    if shared is None and index.short:  # a short prompt is recognised whole, inside another
        line = _token_line(prompt_text(record))
        shared = next((pid for short, pid in index.short if short in line), None)
    if shared:
        hits["prompt_ngram"] = shared
    shared = next((index.grams[g] for g in answer_grams if g in index.grams), None)
    if shared:
        hits["answer_ngram"] = shared
    name = next((index.names[n] for n in names if n in index.names), None)
    if name:
        hits["entry_point_name"] = name
    return hits


def decontaminate(records: list[Record], eval_sets: dict[str, list], action: str = "drop",
                  examples: int = 10) -> tuple[list[Record], list[dict[str, Any]]]:
    """The records that resemble no prompt of any evaluation set, and one report per set.

    A record resembles an evaluation prompt when its prompt is the same text (case and spacing
    folded), when its prompt or its answers share a 13-gram with the prompt or its reference
    answer (word and punctuation tokens, lower-cased; the set's template n-grams, and n-grams
    of fewer than 4 words such as a list of numbers, left out; a prompt shorter than 13 tokens
    counts when its prompt holds it whole), or when it defines
    a function whose normalized name is the prompt's entry point. action
    "drop" removes such records; "fail" raises OverlapError naming them."""
    indexes = [EvalIndex.of(name, prompts) for name, prompts in eval_sets.items()]
    counts = {i.name: dict.fromkeys(CHECKS, 0) | {"records_flagged": 0} for i in indexes}
    shown: dict[str, list[dict[str, Any]]] = {i.name: [] for i in indexes}
    kept: list[Record] = []
    for record in records:
        prompt = prompt_text(record)
        answers = "\n".join(m.content for m in record.messages if m.role == "assistant")
        prompt_grams, answer_grams = _gram_hashes(prompt), _gram_hashes(answers)
        names = defined_names(prompt) | defined_names(answers)
        flagged = False
        for index in indexes:
            hits = _hits(record, index, prompt_grams, answer_grams, names)
            if not hits:
                continue
            flagged = True
            counts[index.name]["records_flagged"] += 1
            for check in hits:
                counts[index.name][check] += 1
            if len(shown[index.name]) < examples:
                shown[index.name].append({"record": record.id, "source": record.source,
                                          "matches": hits})
        if not flagged:
            kept.append(record)
    reports = [{"set": i.name, "eval_prompts": i.size, "records_checked": len(records),
                "ngram": CONTAMINATION_NGRAM, **counts[i.name], "action": action,
                "examples": shown[i.name]} for i in indexes]
    if action == "fail" and len(kept) < len(records):
        found = "; ".join(f"{r['set']}: {r['records_flagged']} records, e.g. "
                          + ", ".join(f"{e['record']} ({'/'.join(e['matches'])} "
                                      f"{next(iter(e['matches'].values()))})"
                                      for e in r["examples"][:2])
                          for r in reports if r["records_flagged"])
        raise OverlapError(
            f"merge: {len(records) - len(kept)} of {len(records)} training records resemble "
            f"evaluation prompts ({found}). Remove them from their sources, or set "
            "merge.decontaminate: drop to leave them out of training")
    return kept, reports
