"""Drafter quality against data size on a real target, in one GPU lease: SmolLM2-135M-Instruct,
HumanEval held out; the drafter kinds and speculators 0.9.0's trainer side by side.

    prompts: python-functions, then python-function-starts (packaged sets, no HumanEval)
    -> generate once (static cache, compiled decode, bf16) -> the answers in one seeded order
    -> for each (drafter, size, epochs): the first N answers -> merge -> train online (the
       target's prefill feeds the rows; no store on disk) -> export (speculators layout)
    -> HumanEval in the embedded engine: float32 target, greedy, chain of 3, 48 prompts x 128
       tokens, spread over worker processes (each decodes its prompts plainly and
       speculatively, so speed is compared under the same load)
    -> speculators 0.9.0's Eagle3DraftModel on the offline store of one size, with its own
       recipe and with draftsmith's, imported and decoded the same way.

The driver runs in the background (setsid) for the whole lease, so device calls only start it
and collect what it wrote. Every job leaves a file behind: a restarted driver skips finished
jobs, and the pipeline's cache skips finished stages. A job is started only when its estimate
fits the budget left; what is not run is recorded as such.

    python benchmarks/quality/sweep.py run --out /tmp/q --report $OUT/.. --budget-s 1500
    python benchmarks/quality/sweep.py run --out /tmp/q-smoke --smoke     # CPU, tiny target
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import lzma
import os
import random
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve()
ROOT = HERE.parents[2]
sys.path.insert(0, str(ROOT))

from draftsmith.artifacts import atomic_write_json  # noqa: E402

log = logging.getLogger("draftsmith.sweep")

SMOLLM2 = "builtin:smollm2-135m-instruct"
GPU = dict(target=SMOLLM2, device="cuda", sizes=[6000, 12000, 48000], epochs=6,
           gen_batch=2048, max_new_tokens=160, batch_tokens=32768, draft_vocab=16384,
           lr=1e-3, validation=0.05, bench_prompts=48, bench_tokens=128, eval_workers=8,
           extract_batch=256, kinds_size=6000, speculators_size=6000, gpu_jobs=3,
           exercise_topics=None)
SMOKE = dict(target="builtin:tiny", device="cpu", sizes=[40, 80], epochs=2, gen_batch=16,
             max_new_tokens=24, batch_tokens=1024, draft_vocab=256, lr=3e-3,
             validation=0.25, bench_prompts=4, bench_tokens=16, eval_workers=2,
             extract_batch=16, kinds_size=40, speculators_size=40, gpu_jobs=1,
             exercise_topics=4)


# --------------------------------------------------------------------------- configs


def pipeline_config(out: Path, size: dict, sources: list[dict], train: dict | None = None,
                    drafter: dict | None = None, mode: str = "online",
                    extract: dict | None = None):
    """The sweep's pipeline config, as examples/smollm2-h200.yaml: the target answers and is
    captured in bf16 on a GPU (training data), and stays float32 for decoding HumanEval
    (token identity with greedy decoding is exact only in float32)."""
    from draftsmith.config import PipelineConfig

    cuda = size["device"].startswith("cuda")
    ttt = 3
    cfg = {
        "run_root": str(out / "runs"),
        "target": {"model": size["target"], "device": size["device"], "dtype": "float32"},
        "data": {"sources": sources},
        "generate": {"max_new_tokens": size["max_new_tokens"], "batch_size": size["gen_batch"],
                     "temperature": 0.0, "dtype": "bfloat16" if cuda else "auto"},
        "merge": {"max_length": 1024, "validation_fraction": size["validation"],
                  "draft_vocab_size": size["draft_vocab"]},
        "extract": {"batch_size": size["extract_batch"], "batch_tokens": size["batch_tokens"],
                    "dtype": "bfloat16" if cuda else "float32",
                    "target_dtype": "bfloat16" if cuda else "auto", **(extract or {})},
        "train": {"ttt_steps": ttt, "lr": size["lr"], "epochs": size["epochs"],
                  "batch_tokens": size["batch_tokens"], "device": size["device"],
                  "dtype": "bfloat16" if cuda else "float32", "log_every": 50,
                  "mode": mode, **(train or {})},
        "export": {"format": "speculators", "speculative_tokens": ttt},
        "benchmark": {"prompts_builtin": "humaneval", "num_prompts": size["bench_prompts"],
                      "max_new_tokens": size["bench_tokens"]},
    }
    if drafter:
        cfg["drafter"] = drafter
    return PipelineConfig.model_validate(cfg)


# --------------------------------------------------------------------------- jobs


@dataclass
class Job:
    """One unit of the sweep: a subprocess (argv) or a function run in the driver. done is a
    file whose existence means the job finished; estimate_s decides whether it still fits."""

    name: str
    done: Path
    estimate_s: float
    after: list[str] = field(default_factory=list)
    # Jobs it only waits for: one that failed does not stop it (the generation benchmark
    # runs before generate so that nothing shares the GPU with it).
    after_ended: list[str] = field(default_factory=list)
    argv: list[str] | None = None
    run: object = None  # a callable run in the driver
    heavy: bool = True  # takes one of the GPU job slots
    workers: int = 0  # evaluation worker processes it needs
    priority: int = 0  # lower first
    started: float | None = None
    process: subprocess.Popen | None = None
    state: str = "waiting"


class Sweep:
    def __init__(self, out: Path, report: Path, size: dict, budget_s: float, smoke: bool):
        self.out, self.report, self.size, self.smoke = out, report, size, smoke
        self.started = time.monotonic()
        self.budget_s = budget_s
        self.jobs: dict[str, Job] = {}
        self.state_path = report / "sweep_state.json"
        (out / "logs").mkdir(parents=True, exist_ok=True)
        report.mkdir(parents=True, exist_ok=True)

    # ---------------------------------------------------------------- scheduling

    def add(self, job: Job) -> None:
        self.jobs[job.name] = job

    def left_s(self) -> float:
        return self.budget_s - (time.monotonic() - self.started)

    def _ready(self, job: Job) -> bool:
        return all(self.jobs[a].state == "done" for a in job.after if a in self.jobs) and \
            all(self.jobs[a].state in ("done", "failed", "skipped") for a in job.after_ended
                if a in self.jobs)

    def _blocked(self, job: Job) -> bool:
        return any(self.jobs[a].state in ("failed", "skipped") for a in job.after
                   if a in self.jobs)

    def run_all(self) -> None:
        while True:
            running = [j for j in self.jobs.values() if j.state == "running"]
            for job in running:
                code = job.process.poll()
                if code is None:
                    continue
                job.state = "done" if code == 0 and job.done.exists() else "failed"
                log.info("job %s %s (rc %s) after %.0f s", job.name, job.state, code,
                         time.monotonic() - job.started)
            waiting = sorted((j for j in self.jobs.values() if j.state == "waiting"),
                             key=lambda j: (j.priority, j.name))
            for job in waiting:
                if job.done.exists():
                    job.state = "done"
                elif self._blocked(job):
                    job.state = "skipped"
                    log.info("job %s skipped: a job it needs did not finish", job.name)
            heavy = sum(j.heavy for j in self.jobs.values() if j.state == "running")
            workers = sum(j.workers for j in self.jobs.values() if j.state == "running")
            for job in (j for j in waiting if j.state == "waiting" and self._ready(j)):
                # The budget decides what to start; an evaluation of a finished training
                # (not heavy, a few minutes) always runs, or the training would be lost.
                if job.heavy and job.estimate_s > self.left_s():
                    job.state = "skipped"
                    log.info("job %s skipped: needs ~%.0f s, %.0f s of the budget left",
                             job.name, job.estimate_s, self.left_s())
                    continue
                if job.heavy and heavy >= self.size["gpu_jobs"]:
                    continue
                if job.workers and workers + job.workers > self.size["eval_workers"]:
                    continue
                self._start(job)
                heavy += job.heavy
                workers += job.workers
            self.save_state()
            if not any(j.state in ("waiting", "running") for j in self.jobs.values()):
                break
            time.sleep(1 if self.smoke else 3)

    def _start(self, job: Job) -> None:
        job.started = time.monotonic()
        log.info("job %s: starting (%.0f s of the budget left)", job.name, self.left_s())
        if job.run is not None:
            try:
                job.run()
                job.state = "done" if job.done.exists() else "failed"
            except Exception:  # noqa: BLE001 - recorded; jobs that need it are skipped
                log.exception("job %s failed", job.name)
                job.state = "failed"
            return
        logfile = open(self.out / "logs" / f"{job.name}.log", "a")  # noqa: SIM115
        job.process = subprocess.Popen(job.argv, stdout=logfile, stderr=subprocess.STDOUT,
                                       cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        job.state = "running"

    def save_state(self) -> None:
        atomic_write_json(self.state_path, {
            "elapsed_s": round(time.monotonic() - self.started, 1),
            "budget_s": self.budget_s,
            "jobs": {j.name: {"state": j.state, "estimate_s": j.estimate_s,
                              "seconds": None if j.started is None else
                              round(time.monotonic() - j.started, 1)}
                     for j in self.jobs.values()}})


# --------------------------------------------------------------------------- the plan


# Drafts a round in every HumanEval measurement (DFlash drafts the first DRAFTS of its block).
DRAFTS = 3
EAGLE31 = {"kind": "eagle3", "norm_before_fc": True, "norm_before_residual": True,
           "norm_output": True}
# Each kind the side by side trains beside EAGLE-3: its drafter section, and what it changes
# in the train and extract sections. eagle3.1-ttt5 trains five steps ahead (it is still
# measured at DRAFTS); eagle3.1-fp32states trains on the hidden states of the float32
# target, the one that HumanEval is decoded with, instead of the bf16 one. eagle3.1-wide4
# and -wide8 give the drafter's MLP 4 and 8 times SmolLM2's width (1,536): whether the one
# layer's capacity holds acceptance back (training and validation full_acc stay level).
KIND_SETTINGS = {"eagle3.1": {"drafter": EAGLE31, "train": {}},
                 "eagle3.1-wide4": {"drafter": {**EAGLE31, "intermediate_size": 6144},
                                    "train": {}},
                 "eagle3.1-wide8": {"drafter": {**EAGLE31, "intermediate_size": 12288},
                                    "train": {}},
                 "eagle3.1-ttt5": {"drafter": EAGLE31, "train": {"ttt_steps": 5}},
                 "eagle3.1-fp32states": {"drafter": EAGLE31, "train": {},
                                         "extract": {"target_dtype": "float32"}},
                 "dflash": {"drafter": {"kind": "dflash"}, "train": {}}}


def me(*args: str) -> list[str]:
    return [sys.executable, str(HERE), *args]


def plan(sweep: Sweep, args) -> None:
    size, out = sweep.size, sweep.out
    args_file = out / "args.json"
    answers = getattr(args, "answers", None)
    answers = str(Path(answers).resolve()) if answers else None
    extra = getattr(args, "extra_answers", None)
    atomic_write_json(args_file, {"size": size, "out": str(out), "report": str(sweep.report),
                                  "answers": answers,
                                  "extra_answers": [str(Path(e).resolve()) for e in extra or []],
                                  "starts_instruction": getattr(args, "starts_instruction", None)})
    common = ["--args", str(args_file)]
    kinds = [k for k in KIND_SETTINGS if k in args.kinds]
    largest = max(size["sizes"] + ([size["kinds_size"]] if kinds else []))
    sweep.add(Job("target", out / "done" / "target", 60, argv=me("target", *common),
                  priority=0))
    per_topic = getattr(args, "exercises", 0)
    if per_topic:
        sweep.add(Job("exercises", out / "done" / "exercises", 300, after=["target"],
                      argv=me("exercises", *common, "--per-topic", str(per_topic),
                              *(["--examples"] if args.exercise_examples else [])),
                      priority=1))
    if not args.no_genbench:
        sweep.add(Job("genbench", out / "done" / "genbench", args.genbench_deadline_s + 70,
                      after=["target"], after_ended=["exercises"],
                      argv=[sys.executable, str(ROOT / "benchmarks/generation_speed.py"),
                            "--out", str(sweep.report / "generation_speed.jsonl"),
                            "--done", str(out / "done" / "genbench"),
                            "--target", size["target"],
                            "--max-new-tokens", str(size["max_new_tokens"]),
                            "--deadline-s", str(args.genbench_deadline_s),
                            *(["--only", *args.genbench] if args.genbench else []),
                            *(["--smoke"] if sweep.smoke else [])],
                      priority=1))
    sweep.add(Job("generate", out / "done" / "generate", 20 if answers else 300,
                  after=["target"], after_ended=["genbench"],
                  argv=me("generate", *common, "--prompts", str(largest)), priority=2))
    # Baselines are decoded by each evaluation worker itself (same load, same process).
    trains = []
    for n in size["sizes"]:
        trains.append(("eagle3", n, size["epochs"], {"drafter": {}, "train": {}}))
    for kind in kinds:
        trains.append((kind, size["kinds_size"], size["epochs"], KIND_SETTINGS[kind]))
    tokens_per_prompt = 245
    for kind, n, epochs, settings in trains:
        name = f"{kind}-{n}-e{epochs}"
        seconds = 60 + n * tokens_per_prompt * epochs / (2.0e5 if not sweep.smoke else 2e3)
        sweep.add(Job(f"train:{name}", out / "done" / f"train-{name}", seconds,
                      after=["generate"],
                      argv=me("train", *common, "--name", name, "--size", str(n),
                              "--epochs", str(epochs), "--drafter", json.dumps(settings["drafter"]),
                              "--train", json.dumps(settings["train"]),
                              "--extract", json.dumps(settings.get("extract", {}))),
                      # The largest size first; then the side by side at kinds_size.
                      priority=2 if n == largest else 3 if n == size["kinds_size"] else 4))
        sweep.add(Job(f"eval:{name}", out / "done" / f"eval-{name}", 120,
                      after=[f"train:{name}"], heavy=False, workers=size["eval_workers"],
                      argv=me("evaluate", *common, "--name", name),
                      # EAGLE-3.1 is the quality candidate: first when two finish together.
                      priority=0 if kind.startswith("eagle3.1") else 1))
    if args.speculators:
        n, epochs = size["speculators_size"], size.get("speculators_epochs") or size["epochs"]
        sweep.add(Job(f"store:{n}", out / "done" / f"store-{n}", 120, after=["generate"],
                      argv=me("store", *common, "--size", str(n)), priority=3))
        # speculators' own recipe first: with one GPU job at a time, it is the one that runs
        # when the budget has room for only one.
        for priority, recipe in enumerate(("speculators", "draftsmith"), start=4):
            name = f"speculators-{recipe}-{n}-e{epochs}"
            sweep.add(Job(f"spec:{name}", out / "done" / f"spec-{name}", 300,
                          after=[f"store:{n}"],
                          argv=me("speculators", *common, "--name", name, "--size", str(n),
                                  "--epochs", str(epochs), "--recipe", recipe),
                          priority=priority))
            sweep.add(Job(f"eval:{name}", out / "done" / f"eval-{name}", 120,
                          after=[f"spec:{name}"], heavy=False, workers=size["eval_workers"],
                          argv=me("evaluate", *common, "--name", name), priority=1))


# --------------------------------------------------------------------------- job bodies


def load_args(path: str) -> dict:
    return json.loads(Path(path).read_text())


def touch(path: Path, content: dict | None = None) -> None:
    atomic_write_json(path, content or {})


def job_target(a: dict) -> None:
    from draftsmith.config import TargetConfig
    from draftsmith.target import resolve_target

    target = resolve_target(TargetConfig(model=a["size"]["target"]))
    touch(Path(a["out"]) / "done" / "target", {"path": target.path, **target.figures})


def sources_for(prompts: int, starts_instruction: str | None = None) -> list[dict]:
    """python-functions first; python-function-starts for the rest (the first set holds
    about 25K prompts in a venv with torch, transformers and vLLM), under starts_instruction
    when given."""
    from draftsmith.data.packaged import (
        PYTHON_FUNCTION_STARTS,
        PYTHON_FUNCTIONS,
        packaged_code_prompts,
    )

    functions = len(packaged_code_prompts(PYTHON_FUNCTIONS, prompts))
    out = [{"name": PYTHON_FUNCTIONS, "builtin": PYTHON_FUNCTIONS, "limit": functions}]
    if functions < prompts:
        out.append({"name": PYTHON_FUNCTION_STARTS, "builtin": PYTHON_FUNCTION_STARTS,
                    "limit": prompts - functions,
                    **({"instruction": starts_instruction} if starts_instruction else {})})
    return out


def _answer_lines(path: Path) -> tuple[list[bytes], str]:
    """The lines of an answers file (plain or .xz) and their sha256."""
    opener = lzma.open if path.suffix == ".xz" else open
    with opener(path, "rb") as f:
        lines = f.read().splitlines(keepends=True)
    return lines, hashlib.sha256(b"".join(lines)).hexdigest()


def answers_from_file(out: Path, path: Path, prompts: int,
                      extra: list[Path] | None = None) -> None:
    """A previous lease's answers (its answers.jsonl, plain or .xz) instead of generating:
    the same prompts answered by the same target, in the same seeded order. extra: more
    answers (the exercises jobs'), joined in the order given and shuffled in among them
    (seeded), so that every size takes its share. Several files give what one file of
    them joined gives, sha256 included."""
    lines, digest = _answer_lines(path)
    done = {"answers_from": str(path), "answers_sha256": digest}
    if extra:
        more = [line for e in extra for line in _answer_lines(e)[0]]
        done["extra_answers_sha256"] = hashlib.sha256(b"".join(more)).hexdigest()
        done["extra_answers_from"] = [str(e) for e in extra]
        done["extra_records"] = len(more)
        lines += more
        random.Random(1).shuffle(lines)
    if len(lines) < prompts:
        raise SystemExit(f"--answers {path}: {len(lines)} answers, but the sweep needs {prompts} "
                         "(its largest size); drop --answers to generate them, or lower "
                         "--sizes / --kinds-size")
    tmp = out / "answers.jsonl.tmp"
    tmp.write_bytes(b"".join(lines))
    os.replace(tmp, out / "answers.jsonl")
    touch(out / "done" / "generate", {**done, "records": len(lines)})


def job_generate(a: dict, prompts: int) -> None:
    """The target answers every prompt once; the answers are written in one seeded order, so
    size N is the first N lines (every smaller size a subset of a larger one)."""
    if a.get("answers"):
        answers_from_file(Path(a["out"]), Path(a["answers"]), prompts,
                          [Path(e) for e in a.get("extra_answers") or []])
        return
    from draftsmith.config import TargetConfig
    from draftsmith.generate.stage import read_records
    from draftsmith.plan import run_in_process
    from draftsmith.target import resolve_target

    out, size = Path(a["out"]), a["size"]
    # Headroom for merge's dedup: a few percent of answers are duplicates.
    sources = sources_for(int(prompts * 1.04), a.get("starts_instruction"))
    cfg = pipeline_config(out, size, sources)
    target = resolve_target(TargetConfig(model=size["target"]))
    started = time.monotonic()
    generated = run_in_process(cfg, target, ["generate"]).outputs["generate"]
    records = read_records(generated)
    write_answers(records, out / "answers.jsonl")
    touch(out / "done" / "generate", {"sources": sources, "records": len(records),
                                      "seconds": round(time.monotonic() - started, 1),
                                      **generated.counts, **generated.figures})


def write_answers(records, path: Path) -> None:
    """Answered records as answers.jsonl lines (id and messages), in one seeded order."""
    records = list(records)
    random.Random(0).shuffle(records)
    with open(path.with_suffix(".tmp"), "w") as f:
        for r in records:
            f.write(json.dumps({"id": r.id, "messages": [
                m.model_dump(include={"role", "content"}) for m in r.messages]}) + "\n")
    os.replace(path.with_suffix(".tmp"), path)


# Long enough for a signature and a docstring with two examples.
EXERCISE_TOKENS = 192
# Two doctest calls and their results, after the forced start of the first.
EXAMPLE_TOKENS = 80


def job_exercises(a: dict, per_topic: int, examples: bool = False) -> None:
    """The target writes per_topic exercises a topic (exercises.py), sampled; the usable ones
    (with the doctest examples it continues, when `examples`) become prompts, which it answers
    greedily as generate answers every prompt: exercise_answers.jsonl, for `--extra-answers`
    of a later lease."""
    import torch
    from exercises import (
        exercise_requests,
        select_exercises,
        with_examples,
        written_exercises,
    )

    from draftsmith.config import TargetConfig
    from draftsmith.generate.stage import read_records
    from draftsmith.generate.transformers_backend import TransformersGenerator, resolve_cache
    from draftsmith.plan import run_in_process
    from draftsmith.target import load_target_model, load_tokenizer, resolve_target

    out, size = Path(a["out"]), a["size"]
    work = out / "exercises"
    work.mkdir(parents=True, exist_ok=True)
    target = resolve_target(TargetConfig(model=size["target"]))
    cuda = size["device"].startswith("cuda")
    started = time.monotonic()
    model = load_target_model(target.path, size["device"], "bfloat16" if cuda else "float32")
    tokenizer = load_tokenizer(target)
    requests = exercise_requests(per_topic, size.get("exercise_topics"))
    generator = TransformersGenerator(
        model, tokenizer, max_new_tokens=EXERCISE_TOKENS, temperature=0.8, top_p=1.0, seed=0,
        cache=resolve_cache("auto", model.device), batch_size=size["gen_batch"])
    # The static cache holds the longest prompt: one shape for every batch.
    generator.longest_prompt = max(map(len, generator.prompt_tokens(
        [[{"role": "user", "content": text}] for _, text in requests])))
    written = written_exercises(generator, requests, size["gen_batch"], progress=lambda done,
                                total: log.info("exercises: %d of %d written", done, total))
    write_s = time.monotonic() - started

    def add_examples(heads: list[str]) -> list[str]:
        greedy = TransformersGenerator(
            model, tokenizer, max_new_tokens=EXAMPLE_TOKENS, temperature=0.0,
            top_p=1.0, seed=0, cache=generator.cache, batch_size=size["gen_batch"],
            longest_prompt=max(map(len, tokenizer(heads)["input_ids"]), default=0) + 64)
        return with_examples(greedy, heads, size["gen_batch"])

    kept, counts = select_exercises(written, add_examples=add_examples if examples else None)
    generator = model = None  # the generate stage loads the target again
    if cuda:
        torch.cuda.empty_cache()
    log.info("exercises: %s", counts)
    if not kept:
        raise SystemExit(f"exercises: none of the {len(written)} written is usable ({counts}): "
                         f"the target {size['target']} does not write documented functions")
    prompts = work / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": k["id"], "topic": k["topic"],
                                           "messages": k["messages"]}) + "\n" for k in kept))
    cfg = pipeline_config(work, size, [{"name": "exercises", "path": str(prompts)}])
    generated = run_in_process(cfg, target, ["generate"]).outputs["generate"]
    write_answers(read_records(generated), out / "exercise_answers.jsonl")
    touch(out / "done" / "exercises", {
        "per_topic": per_topic, "with_examples": examples, **counts,
        "write_seconds": round(write_s, 1),
        "seconds": round(time.monotonic() - started, 1), "answers": generated.counts,
        "examples": [{"topic": k["topic"], "head": k["head"]} for k in kept[:20]]})


def answers_source(out: Path, n: int) -> list[dict]:
    """The first n answers as a data source file (written once)."""
    path = out / f"answers-{n}.jsonl"
    if not path.exists():
        with open(out / "answers.jsonl") as f:
            lines = [line for _, line in zip(range(n), f, strict=False)]
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text("".join(lines))
        os.replace(tmp, path)
    return [{"name": "answers", "path": str(path)}]


def share_the_gpu() -> None:
    """The sweep runs several jobs on one GPU at once, by design: the stages' check that no
    other process holds the GPUs (meant for a server's devices) is turned off here."""
    import draftsmith.preflight as preflight

    preflight.require_free_stage_gpus = lambda *args, **kwargs: None


def prepared(cfg, target, n: int, out: Path) -> None:
    """generate, merge and (online: the capture settings) extract of a size, once: jobs of
    one size wait on its lock, so only the first computes them and the others find them
    cached."""
    from filelock import FileLock

    from draftsmith.plan import run_in_process

    with FileLock(str(out / f"answers-{n}.lock")):
        run_in_process(cfg, target, ["generate", "merge", "extract"])


def job_train(a: dict, name: str, n: int, epochs: int, drafter: dict, train: dict,
              extract: dict | None = None) -> None:
    from draftsmith.config import TargetConfig
    from draftsmith.plan import run_in_process
    from draftsmith.target import resolve_target

    out, size = Path(a["out"]), {**a["size"], "epochs": epochs}
    cfg = pipeline_config(out, size, answers_source(out, n), train=train or None,
                          drafter=drafter or None, extract=extract or None)
    target = resolve_target(TargetConfig(model=size["target"]))
    share_the_gpu()
    prepared(cfg, target, n, out)
    seconds: dict[str, float] = {}
    outputs = {}

    def after(stage, descriptor, took):
        outputs[stage] = descriptor
        seconds[stage] = round(took, 1)

    run_in_process(cfg, target, ["generate", "merge", "extract", "train", "export"],
                   after=after)
    history = [json.loads(line) for line in
               (outputs["train"].dir / "metrics.jsonl").read_text().splitlines()]
    touch(out / "done" / f"train-{name}", {
        "name": name, "prompts": n, "epochs": epochs, "drafter": drafter or {"kind": "eagle3"},
        "train_settings": train, "extract_settings": extract or {}, "seconds": seconds,
        "train": {**outputs["train"].counts, **outputs["train"].figures},
        "merge": outputs["merge"].counts, "train_dir": str(outputs["train"].dir),
        "drafter_dir": outputs["export"].figures["drafter_dir"],
        "validation": [h for h in history if h["split"] == "validation"],
        "train_tokens_per_s": [h["tokens_per_s"] for h in history if h["split"] == "train"]})


def job_store(a: dict, n: int) -> None:
    """The offline hidden-state store of size n (speculators trains from a store)."""
    from draftsmith.config import TargetConfig
    from draftsmith.plan import run_in_process
    from draftsmith.target import resolve_target

    out, size = Path(a["out"]), a["size"]
    cfg = pipeline_config(out, size, answers_source(out, n), mode="offline")
    target = resolve_target(TargetConfig(model=size["target"]))
    share_the_gpu()
    prepared(cfg, target, n, out)
    run = run_in_process(cfg, target, ["generate", "merge", "extract"])
    touch(out / "done" / f"store-{n}", {"store": run.outputs["extract"].path,
                                        "merge_dir": str(run.outputs["merge"].dir),
                                        **run.outputs["extract"].counts})


def humaneval_prompts(a: dict) -> list[list[int]]:
    from draftsmith.bench.benchmark import held_out_prompts
    from draftsmith.config import TargetConfig
    from draftsmith.target import load_tokenizer, resolve_target

    size = a["size"]
    cfg = pipeline_config(Path(a["out"]), size, [{"name": "x", "path": "unused.jsonl"}])
    target = resolve_target(TargetConfig(model=size["target"]))
    return held_out_prompts(cfg.benchmark, None, load_tokenizer(target))


def job_evaluate(a: dict, name: str) -> None:
    """The drafter on HumanEval in the embedded engine, over eval_workers processes; the
    per-prompt records are summed into one row."""
    out, size = Path(a["out"]), a["size"]
    done = json.loads((out / "done" / f"{'spec' if name.startswith('spec') else 'train'}-"
                       f"{name}").read_text())
    parts = out / "eval" / name
    parts.mkdir(parents=True, exist_ok=True)
    workers = size["eval_workers"]
    procs = [subprocess.Popen(me("eval-worker", "--args", a["_path"], "--drafter-dir",
                                 done["drafter_dir"], "--worker", str(w), "--workers",
                                 str(workers), "--part", str(parts / f"{w}.json")),
                              cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
             for w in range(workers)]
    codes = [p.wait() for p in procs]
    if any(codes):
        raise RuntimeError(f"evaluation workers of {name} exited with {codes}")
    results = [json.loads((parts / f"{w}.json").read_text()) for w in range(workers)]
    per_prompt = [p for r in results for p in r["prompts"]]
    bf16_states = {k: sum(r["bf16_states"][k] for r in results) for k in ("rounds", "tokens")}
    touch(out / "done" / f"eval-{name}", summarize(name, done, per_prompt, bf16_states))


def summarize(name: str, done: dict, per_prompt: list[dict],
              bf16_states: dict | None = None) -> dict:
    rounds = sum(p["verify_rounds"] for p in per_prompt)
    tokens = sum(p["round_tokens"] for p in per_prompt)
    positions = [sum(col) for col in zip(*(p["accepted_by_position"] for p in per_prompt),
                                         strict=True)]
    spec_s = sum(p["speculative_s"] for p in per_prompt)
    plain_s = sum(p["greedy_s"] for p in per_prompt)
    spec_tokens = sum(p["completion_tokens"] for p in per_prompt)
    plain_tokens = sum(p["plain_tokens"] for p in per_prompt)
    draft_s = sum(p.get("draft_s", 0.0) for p in per_prompt)
    verify_s = sum(p.get("verify_s", 0.0) for p in per_prompt)
    validation = done.get("validation") or []
    best = max(validation, key=lambda h: h["tau"]) if validation else {}
    steps = sum(1 for k in best if k.startswith("full_acc_"))
    measured = tokens / max(rounds, 1)
    return {
        "drafter": name, "kind": done.get("kind_label") or name.rsplit("-", 2)[0],
        "prompts": done.get("prompts"), "epochs": done.get("epochs"),
        "best_epoch": best.get("epoch"), "ttt_steps": steps or None,
        "full_acc": [round(best[f"full_acc_{j}"], 4) for j in range(steps)],
        "tau": round(best["tau"], 4) if best else None,
        "replayed": round(best["acceptance_replayed"], 4)
        if best.get("acceptance_replayed") is not None else None,
        "measured_embedded": round(measured, 4),
        "replayed_bf16_states": round(bf16_states["tokens"] / bf16_states["rounds"], 4)
        if bf16_states else None,
        "accepted_per_position": [round(x / max(rounds, 1), 4) for x in positions],
        "measured_vllm": None,
        "speedup_embedded": round((spec_tokens / spec_s) / (plain_tokens / plain_s), 3),
        "speedup_vllm_c1": None, "speedup_vllm_c4": None,
        "identical": sum(p["identical"] for p in per_prompt) == len(per_prompt),
        "identical_prompts": f"{sum(p['identical'] for p in per_prompt)}/{len(per_prompt)}",
        "humaneval_prompts": len(per_prompt), "verify_rounds": rounds,
        "ms_per_round": {"draft": round(1000 * draft_s / max(rounds, 1), 2),
                         "verify": round(1000 * verify_s / max(rounds, 1), 2),
                         "all": round(1000 * spec_s / max(rounds, 1), 2)},
        "ms_per_plain_token": round(1000 * plain_s / max(plain_tokens, 1), 2),
        # The replay drafts as many tokens a round as training predicted (DFlash: its whole
        # block); it matches the measurement only when that is the measurement's DRAFTS.
        "replay_gap": round(abs(best["acceptance_replayed"] - measured) / measured, 4)
        if best.get("acceptance_replayed") and steps == DRAFTS else None,
        "train_seconds": done.get("seconds"), "train_tokens_per_s": done.get("train_tokens_per_s"),
        "drafter_dir": done.get("drafter_dir"), "extra": done.get("extra"),
    }


def paired_decoding(engine, prompts: list[list[int]], bench, eos: int | None) -> list[dict]:
    """Each prompt decoded plainly, then speculatively, before the next one. Training jobs
    share the GPU with the evaluation and their load changes by the minute; decoding all the
    plain prompts first and all the speculative ones later gave speedups from 0.79x to 2.29x
    for one drafter. In pairs, both decodings of a prompt meet the same load."""
    from draftsmith.bench.benchmark import measure_embedded, plain_decoding

    cold = bench.model_copy(update={"warmup_prompts": 0})  # the first pair warms both paths
    per_prompt: list[dict] = []
    for i, prompt in enumerate(prompts):
        settings = bench if i == 0 else cold
        plain = plain_decoding(engine.runner, [prompt], settings, eos)
        row = measure_embedded(engine, [prompt], settings, eos, "sweep", plain)[1][0]
        per_prompt.append({**row, "greedy_tokens": plain[0].tokens})
    return per_prompt


def job_eval_worker(a: dict, drafter_dir: str, worker: int, workers: int, part: Path) -> None:
    """This worker's share of the HumanEval prompts, each decoded plainly and speculatively
    in a pair (`paired_decoding`), with a float32 target (token identity with greedy decoding
    is exact only in float32)."""
    import torch

    from draftsmith.bench.guard import replayed_acceptance
    from draftsmith.config import TargetConfig
    from draftsmith.serve.embedded import EmbeddedSpeculativeEngine
    from draftsmith.target import load_target_model, load_tokenizer, resolve_target

    torch.set_num_threads(1)
    size = a["size"]
    cfg = pipeline_config(Path(a["out"]), size, [{"name": "x", "path": "unused.jsonl"}])
    target = resolve_target(TargetConfig(model=size["target"]))
    prompts = humaneval_prompts(a)[worker::workers]
    model = load_target_model(target.path, size["device"], "float32")
    eos = load_tokenizer(target).eos_token_id
    engine = EmbeddedSpeculativeEngine.load(model, drafter_dir, num_steps=DRAFTS)
    per_prompt = paired_decoding(engine, prompts, cfg.benchmark, eos)
    engine.runner.close()
    # The same greedy outputs replayed over the bf16 target's states, the ones every drafter
    # here trains on: how much of the gap between the validation replay and HumanEval is the
    # float32 target (decoded for exact identity) rather than the prompts.
    outputs = [row.pop("greedy_tokens") for row in per_prompt]
    bf16 = TargetConfig(model=size["target"], device=size["device"], dtype="bfloat16")
    bf16_states = replayed_acceptance(drafter_dir, target.path, bf16, "llama", DRAFTS,
                                      prompts, outputs)
    touch(part, {"prompts": per_prompt, "bf16_states": bf16_states})


# --------------------------------------------------------------------------- speculators


def job_speculators(a: dict, name: str, n: int, epochs: int, recipe: str) -> None:
    """speculators 0.9.0 trains its default drafter (EAGLE-3.1 norms, flex attention, fused
    kl_div loss) on the store of size n, with its recipe (muon + AdamW, linear schedule) or
    draftsmith's (AdamW, cosine with warm-up, the same lr); then `draftsmith import`."""
    from speculators_side import train_speculators, validation_of

    out, size = Path(a["out"]), a["size"]
    store = json.loads((out / "done" / f"store-{n}").read_text())
    result = train_speculators(store, size, out / "speculators" / name, recipe, epochs)
    train_cfg = pipeline_config(out, size, answers_source(out, n), mode="offline").train
    validation = validation_of(Path(result["imported"]), store, size, train_cfg)
    # The earlier side by side decoded in the process that had trained speculators' model;
    # the same decoding here, next to the evaluation workers' fresh processes, tells a slow
    # drafter from a slow process.
    reference = out / "done" / f"train-eagle3-{n}-e{epochs}"
    drafters = {"speculators": result["imported"]}
    if reference.exists():
        drafters["draftsmith"] = json.loads(reference.read_text())["drafter_dir"]
    result["in_process_decode"] = decode_in_process(a, drafters, prompts=8)
    touch(out / "done" / f"spec-{name}", {"name": name, "prompts": n, "epochs": epochs,
                                         "kind_label": "eagle3.1",
                                         "drafter_dir": result["imported"],
                                         "validation": [validation], "extra": result})


def decode_in_process(a: dict, drafters: dict[str, str], prompts: int) -> dict:
    """The first HumanEval prompts through each drafter in this process (as the benchmark
    stage and the earlier side by side decode): acceptance and milliseconds per round."""
    from draftsmith.bench.benchmark import measure_embedded, plain_decoding
    from draftsmith.config import TargetConfig
    from draftsmith.serve.embedded import EmbeddedSpeculativeEngine
    from draftsmith.target import load_target_model, load_tokenizer, resolve_target

    size = a["size"]
    cfg = pipeline_config(Path(a["out"]), size, [{"name": "x", "path": "unused.jsonl"}])
    target = resolve_target(TargetConfig(model=size["target"]))
    model = load_target_model(target.path, size["device"], "float32")
    eos = load_tokenizer(target).eos_token_id
    chosen = humaneval_prompts(a)[:prompts]
    plain, out = None, {}
    for name, directory in drafters.items():
        engine = EmbeddedSpeculativeEngine.load(model, directory, num_steps=DRAFTS)
        plain = plain or plain_decoding(engine.runner, chosen, cfg.benchmark, eos)
        _, per_prompt = measure_embedded(engine, chosen, cfg.benchmark, eos, name, plain)
        engine.runner.close()
        row = summarize(name, {}, per_prompt)
        out[name] = {k: row[k] for k in ("measured_embedded", "speedup_embedded",
                                         "ms_per_round", "ms_per_plain_token", "identical")}
    return out


# --------------------------------------------------------------------------- report


def write_report(out: Path, report: Path) -> None:
    rows = [json.loads(p.read_text()) for p in sorted((out / "done").glob("eval-*"))]
    atomic_write_json(report / "summary.json", rows)
    for name in ("generate", "target", "exercises"):
        if (out / "done" / name).exists():
            atomic_write_json(report / f"{name}.json", json.loads((out / "done" / name)
                                                                   .read_text()))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="the driver")
    run.add_argument("--out", type=Path, required=True)
    run.add_argument("--report", type=Path, help="summary files (default: OUT/report)")
    run.add_argument("--budget-s", type=float, default=1e9)
    run.add_argument("--smoke", action="store_true")
    run.add_argument("--sizes", type=int, nargs="*")
    run.add_argument("--target", help="default: SmolLM2 (the tiny target with --smoke)")
    run.add_argument("--epochs", type=int)
    run.add_argument("--kinds", nargs="*", default=["eagle3.1", "dflash"])
    run.add_argument("--kinds-size", type=int, help="prompts of the kinds' side by side "
                     "(default: 6,000; the tiny target's 40 with --smoke)")
    run.add_argument("--speculators", action="store_true")
    run.add_argument("--speculators-epochs", type=int,
                     help="speculators' trainer's epochs (default: --epochs), so that its side "
                     "by side keeps its own epochs beside a longer or shorter main run")
    run.add_argument("--answers", help="a previous lease's answers.jsonl (or .jsonl.xz) "
                     "instead of the generate job: it saves generation's 3-4 minutes")
    run.add_argument("--starts-instruction", help="ask the python-function-starts prompts "
                     "with this instruction instead of HumanEval's (e.g. for the function "
                     "and then an explanation, as SmolLM2 answers HumanEval; see "
                     "answer_shape.py); the answers are generated anew")
    run.add_argument("--extra-answers", nargs="+", help="more answers, shuffled in among "
                     "--answers' (exercises jobs' exercise_answers.jsonl[.xz]; several files "
                     "are joined in the order given)")
    run.add_argument("--exercises", type=int, default=0, metavar="PER_TOPIC",
                     help="the exercises job: the target writes PER_TOPIC exercises a topic "
                     "and answers the usable ones (exercises.py)")
    run.add_argument("--exercise-examples", action="store_true",
                     help="the exercises job also has the target add doctest examples to each "
                     "kept exercise (exercises.with_examples)")
    run.add_argument("--no-genbench", action="store_true")
    run.add_argument("--genbench", nargs="*", help="generation_speed.py's variants to run "
                     "(default: all, as the deadline allows)")
    run.add_argument("--genbench-deadline-s", type=int, default=170,
                     help="start no generation variant after this many seconds")
    run.add_argument("--only", nargs="*", help="run only the jobs whose names contain one of "
                     "these (a second driver beside a running one)")
    run.add_argument("--gpu-jobs", type=int)
    for name in ("target", "generate", "exercises", "train", "store", "evaluate",
                 "eval-worker", "speculators"):
        p = sub.add_parser(name)
        p.add_argument("--args", required=True)
        p.add_argument("--name")
        p.add_argument("--size", type=int)
        p.add_argument("--epochs", type=int)
        p.add_argument("--drafter", default="{}")
        p.add_argument("--train", default="{}", help="train settings over the sweep's")
        p.add_argument("--extract", default="{}", help="extract settings over the sweep's")
        p.add_argument("--drafter-dir")
        p.add_argument("--prompts", type=int)
        p.add_argument("--recipe")
        p.add_argument("--worker", type=int)
        p.add_argument("--workers", type=int)
        p.add_argument("--part", type=Path)
        p.add_argument("--per-topic", type=int)
        p.add_argument("--examples", action="store_true")
    args = parser.parse_args(argv)
    from draftsmith.logs import configure_logging

    configure_logging()
    logging.getLogger("draftsmith.sweep").setLevel(logging.INFO)
    if args.command == "run":
        size = dict(SMOKE if args.smoke else GPU)
        if args.sizes:
            size["sizes"] = args.sizes
        if args.epochs:
            size["epochs"] = args.epochs
        if args.target:
            size["target"] = args.target
        if args.kinds_size:
            size["kinds_size"] = args.kinds_size
        if args.speculators_epochs:
            size["speculators_epochs"] = args.speculators_epochs
        if args.extra_answers and not args.answers:
            parser.error("--extra-answers joins --answers: give both")
        if args.answers and args.starts_instruction:
            parser.error("--answers holds answers to the default instruction: drop it when "
                         "giving --starts-instruction (the answers are generated anew)")
        args.out.mkdir(parents=True, exist_ok=True)
        os.environ.setdefault("DRAFTSMITH_CACHE", str(args.out / "cache"))
        sweep = Sweep(args.out, args.report or args.out / "report", size, args.budget_s,
                      args.smoke)
        if args.gpu_jobs:
            size["gpu_jobs"] = args.gpu_jobs
        plan(sweep, args)
        if args.only:
            sweep.jobs = {k: j for k, j in sweep.jobs.items() if any(o in k for o in args.only)}
        try:
            sweep.run_all()
        finally:
            write_report(args.out, sweep.report)
        return
    a = load_args(args.args)
    a["_path"] = args.args
    sys.path.insert(0, str(HERE.parent))
    {"target": lambda: job_target(a),
     "generate": lambda: job_generate(a, args.prompts),
     "exercises": lambda: job_exercises(a, args.per_topic, args.examples),
     "train": lambda: job_train(a, args.name, args.size, args.epochs, json.loads(args.drafter),
                                json.loads(args.train), json.loads(args.extract)),
     "store": lambda: job_store(a, args.size),
     "evaluate": lambda: job_evaluate(a, args.name),
     "eval-worker": lambda: job_eval_worker(a, args.drafter_dir, args.worker, args.workers,
                                            args.part),
     "speculators": lambda: job_speculators(a, args.name, args.size, args.epochs,
                                            args.recipe),
     }[args.command]()


if __name__ == "__main__":
    main()
