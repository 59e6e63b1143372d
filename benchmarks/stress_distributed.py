"""Run the two-process gloo training jobs of tests/test_train_loop.py (DDP and FSDP, offline
and online) again and again under torchrun, and count how each attempt ended.

An attempt ends `ok` (torchrun exited 0 with the result), `abort` (a rank died by SIGABRT, the
issue-29 shape: "terminate called without an active exception") or `crash` (any other
failure). Each line says which, with the load average, the seconds it took and, for a
failure, the ranks' exit lines and the Python stacks faulthandler printed when the rank
aborted. Failing attempts' logs are copied next to the output.

With --suite, a round is instead the code's own tests/test_train_loop.py under two
pytest-xdist workers that take tests one at a time (`--dist load`), so the FSDP runs share the
machine with other torchrun jobs, as in the suite: every torchrun attempt logged under the
round's pytest directory is counted, except those of the test that aborts a rank on purpose.
On the old code (999db31) this caught the abort that the jobs alone never did.

Usage (benchmarks/stress_distributed.sh starts the CPU burners around it):
    python benchmarks/stress_distributed.py --rounds 30 --work /tmp/x --keep DIR [--suite]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

MODES = {  # name: (train.parallel, train.mode)
    "ddp-offline": ("ddp", "offline"),
    "fsdp-offline": ("fsdp", "offline"),
    "ddp-online": ("ddp", "online"),
    "fsdp-online": ("fsdp", "online"),
}
REPO = Path(__file__).resolve().parents[1]


def prepare(work: Path) -> dict:
    """generate -> merge -> extract on the random tiny target, as the tests' `inputs` fixture
    does (built once in `work`, reused by later invocations)."""
    from draftsmith.artifacts import plan_stage, read_descriptor
    from draftsmith.config import (
        DataConfig,
        ExtractConfig,
        GenerateConfig,
        MergeConfig,
        TargetConfig,
    )
    from draftsmith.data.merge import run_merge
    from draftsmith.extract.stage import record_online_capture, run_extract
    from draftsmith.generate.stage import run_generate
    from draftsmith.target import resolve_target
    from draftsmith.tiny_target import build_tiny_target

    target_dir = work / "random-tiny"
    if not (target_dir / "config.json").is_file():
        build_tiny_target(target_dir, train_steps=0, vocab_size=512, hidden_size=64,
                          intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
    target_cfg = TargetConfig(model=str(target_dir))
    target = resolve_target(target_cfg)
    data = DataConfig(sources=[
        {"name": "sg", "path": str(REPO / "examples/data/sharegpt.jsonl"), "limit": 16},
        {"name": "oa", "path": str(REPO / "examples/data/openai.jsonl"), "limit": 16},
    ])
    root = work / "inputs"

    def stage(name, cfg, inputs, run):
        plan = plan_stage(root, name, cfg, inputs)
        return read_descriptor(plan) if plan.is_complete() else run(plan)

    gen = stage("generate", {}, [target], lambda p: run_generate(
        GenerateConfig(max_new_tokens=8, batch_size=16), data, target_cfg, target, p))
    merged = stage("merge", {}, [gen], lambda p: run_merge(
        MergeConfig(max_length=64, validation_fraction=0.25, draft_vocab_size=128), gen,
        target, p))
    extract = ExtractConfig(shard_tokens=400)
    hidden = stage("extract", {}, [merged], lambda p: run_extract(
        extract, target_cfg, merged, target, p))
    online = stage("extract", {"online": True}, [merged], lambda p: record_online_capture(
        extract, merged, target, p))
    return {"target": target, "target_cfg": target_cfg, "merged": merged, "hidden": hidden,
            "online_hidden": online, "extract": extract}


def outcome(err: BaseException | None, log_text: str) -> str:
    """Read from the log first: a rank that aborts after every rank finished no longer fails
    the stage (its result is kept), and it is still an abort."""
    if re.search(r"Signal 6 \(SIGABRT\)|exitcode\s*:\s*-6|terminate called", log_text):
        return "abort"
    if err is not None or re.search(r"exitcode\s*:\s*-?[1-9]", log_text):
        return "crash"
    return "ok"


def evidence(log_text: str) -> list[str]:
    """The lines that say how a rank ended: torchrun's per-rank summary, C++ terminate
    messages and faulthandler's stacks."""
    keep = re.compile(r"terminate called|Fatal Python error|Thread 0x|Current thread|File \"|"
                      r"exitcode|Signal \d+|rank\s*:|error_file|Error:|Aborted|core dumped")
    return [line for line in log_text.splitlines() if keep.search(line)][-80:]


def backtrace(core: Path) -> str:
    """gdb's backtrace of every thread in a core file, the frames' function names only."""
    gdb = subprocess.run(["gdb", "-batch", "-ex", "thread apply all bt 40", sys.executable,
                          str(core)], capture_output=True, text=True, timeout=900)
    lines = [f"  gdb {core.name}:"]
    for line in gdb.stdout.splitlines():
        if line.startswith(("Thread ", "#", "Core was generated", "Program terminated")):
            lines.append("  " + line[:240])
    return "\n".join(lines)


def code_under_test() -> tuple[Path, str]:
    """The checkout whose draftsmith is imported (CODE= in the shell script), and a line that
    names its commit."""
    import draftsmith

    code = Path(draftsmith.__file__).resolve().parents[1]
    commit = subprocess.run(["git", "-C", str(code), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(code), "status", "--porcelain", "draftsmith"],
                           capture_output=True, text=True).stdout.strip()
    return code, f"{code} at {commit}{' (draftsmith/ modified)' if dirty else ''}"


DELIBERATE_ABORT = "test_a_rank_that_dies"  # its rank 1 aborts on purpose (a test of 29's fix)


def suite_round(code: Path, basetemp: Path, keep: Path, round_: int) -> dict[str, int]:
    """One run of `code`'s tests/test_train_loop.py with two xdist workers; the outcome of
    every torchrun attempt it logged (a train.log holds one attempt per `$ torchrun` line)."""
    shutil.rmtree(basetemp, ignore_errors=True)
    start = time.monotonic()
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "load",
         "-p", "no:cacheprovider", f"--basetemp={basetemp}", "tests/test_train_loop.py"],
        cwd=code,
        env={**os.environ, "PYTHONPATH": str(code)}, capture_output=True, text=True,
        timeout=3600)
    counts = {"ok": 0, "abort": 0, "crash": 0}
    aborted = []
    for log in sorted(basetemp.rglob("train.log")):
        if any(part.startswith(DELIBERATE_ABORT) for part in log.relative_to(basetemp).parts):
            continue
        for attempt in log.read_text(errors="replace").split("\n$ "):
            result = outcome(None, attempt)
            counts[result] += 1
            if result == "abort":
                aborted.append((log, attempt))
    load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    summary = (run.stdout.strip().splitlines() or ["(no output)"])[-1]
    print(f"round {round_} suite: {counts['abort']} aborts in {sum(counts.values())} torchrun "
          f"attempts ({counts['crash']} ended otherwise, most of them killed on purpose); "
          f"pytest exit {run.returncode}: {summary}; {time.monotonic() - start:.0f} s, "
          f"load {load}", flush=True)
    for n, (log, attempt) in enumerate(aborted, 1):
        keep.mkdir(parents=True, exist_ok=True)
        kept = keep / f"round{round_}-suite-{n}-{log.parent.parent.name}-{log.parent.name}.log"
        kept.write_text(attempt)
        print(json.dumps({"log": str(log.relative_to(basetemp)), "kept": str(kept),
                          "evidence": evidence(attempt)}, indent=1), flush=True)
    return counts


def run_once(name: str, inputs: dict, out: Path) -> tuple[str, float, dict]:
    from draftsmith.config import TrainConfig
    from draftsmith.train.launch import LOG_FILE, RESULT_FILE, run_torchrun
    from draftsmith.train.trainer import OnlineInputs

    parallel, mode = MODES[name]
    # tests/test_train_loop.py's torchrun_cfg: odd row counts, a checkpoint every 2 steps.
    cfg = TrainConfig(ttt_steps=2, lr=3e-3, epochs=2, batch_tokens=112, log_every=1,
                      warmup_ratio=0.2, nproc_per_node=2, checkpoint_every=2,
                      parallel=parallel, mode=mode)
    online = OnlineInputs(inputs["extract"], inputs["target_cfg"]) if mode == "online" else None
    hidden = inputs["online_hidden"] if online else inputs["hidden"]
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    start, err = time.monotonic(), None
    try:
        run_torchrun(cfg, hidden, inputs["merged"], inputs["target"], out, online=online)
    except Exception as e:  # noqa: BLE001 - every failure is counted and described
        err = e
    seconds = time.monotonic() - start
    log_text = (out / LOG_FILE).read_text(errors="replace") if (out / LOG_FILE).is_file() else ""
    detail = {"error": None if err is None else f"{type(err).__name__}: {str(err)[:300]}",
              "result_file_left": (out / RESULT_FILE).is_file()}
    return outcome(err, log_text), seconds, {**detail, "evidence": evidence(log_text),
                                             "log_text": log_text}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated, of "
                        + ", ".join(MODES))
    parser.add_argument("--work", type=Path, required=True, help="scratch directory")
    parser.add_argument("--keep", type=Path, required=True,
                        help="where the logs of failed attempts are copied")
    parser.add_argument("--probe", action="store_true",
                        help="run the ranks through benchmarks/stress_probe_worker.py and "
                        "print the gloo worker threads each rank runs after Dist.close")
    parser.add_argument("--cores", action="store_true",
                        help="let ranks dump core (in --work) and print gdb's backtrace of "
                        "every thread of an aborted rank (the core is deleted after)")
    parser.add_argument("--suite", action="store_true",
                        help="a round is the code's tests/test_train_loop.py under two "
                        "pytest-xdist workers, as the suite runs it (see above)")
    args = parser.parse_args()
    if args.suite:
        code, described = code_under_test()
        print(f"# code {described}; {args.rounds} rounds of its tests/test_train_loop.py "
              f"(pytest -n 2); {os.cpu_count()} cores", flush=True)
        total = {"ok": 0, "abort": 0, "crash": 0}
        rounds_aborted = 0
        for round_ in range(1, args.rounds + 1):
            counts = suite_round(code, args.work / "suite", args.keep, round_)
            rounds_aborted += counts["abort"] > 0
            total = {k: total[k] + counts[k] for k in total}
        print(f"# summary: {args.rounds} rounds, {sum(total.values())} torchrun attempts: "
              f"{total['abort']} aborts (in {rounds_aborted} rounds), {total['ok']} ok, "
              f"{total['crash']} ended otherwise", flush=True)
        return
    modes = args.modes.split(",")
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        sys.exit(f"--modes: unknown {unknown}; choose from {', '.join(MODES)}")
    args.work.mkdir(parents=True, exist_ok=True)
    if args.cores:  # inherited by torchrun and its ranks; core_pattern "core" = their cwd
        resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY,
                                                  resource.RLIM_INFINITY))
        os.chdir(args.work)
    inputs = prepare(args.work)
    if args.probe:
        from draftsmith.train import launch

        plain = launch.torchrun_argv
        probe = str(Path(__file__).with_name("stress_probe_worker.py"))

        def probed(cfg, job):  # `-m draftsmith.train.worker` -> the probe script
            argv = plain(cfg, job)
            at = argv.index("draftsmith.train.worker")
            return argv[:at - 1] + [probe] + argv[at + 1:]

        launch.torchrun_argv = probed
    code, described = code_under_test()
    print(f"# code {described}; {args.rounds} rounds of {modes}; {os.cpu_count()} cores",
          flush=True)
    counts: dict[str, dict[str, int]] = {m: {"ok": 0, "abort": 0, "crash": 0} for m in modes}
    for round_ in range(1, args.rounds + 1):
        for name in modes:
            out = args.work / "runs" / name
            result, seconds, detail = run_once(name, inputs, out)
            counts[name][result] += 1
            load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
            probes = re.findall(r"(rank\d) probe: (\d+) gloo worker threads before Dist.close, "
                                r"(\d+) after", detail.pop("log_text"))
            left = "; gloo threads left after close: " + ", ".join(
                f"{r} {after} of {before}" for r, before, after in sorted(probes)) \
                if probes else ""
            print(f"round {round_} {name}: {result} in {seconds:.1f} s, load {load}{left}",
                  flush=True)
            if result != "ok":
                print(json.dumps(detail, indent=1), flush=True)
                args.keep.mkdir(parents=True, exist_ok=True)
                kept = args.keep / f"round{round_}-{name}-train.log"
                shutil.copy(out / "train.log", kept)
                print(f"  log kept: {kept}", flush=True)
            for core in sorted(Path.cwd().glob("core*")) if args.cores else []:
                print(backtrace(core), flush=True)
                core.unlink()
    total = {k: sum(c[k] for c in counts.values()) for k in ("ok", "abort", "crash")}
    print(f"# summary: {sum(total.values())} attempts: {total['ok']} ok, {total['abort']} "
          f"aborts, {total['crash']} other failures; per mode {json.dumps(counts)}", flush=True)


if __name__ == "__main__":
    main()
