"""Run every engine stage (no Prefect) on one device and print what each did and how long it
took: the demo pipeline on a GPU, to catch what only breaks there (devices, bf16).

    python benchmarks/stages_on_device.py --device cuda --dtype bfloat16 --out /tmp/ds
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

from draftsmith.artifacts import plan_stage
from draftsmith.config import load_config
from draftsmith.target import resolve_target

REPO = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--out", default="/tmp/draftsmith-device")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    train_dtype = "bfloat16" if args.dtype == "bfloat16" else "float32"
    config = load_config(REPO / "examples" / "tiny.yaml", [
        f"run_root={args.out}", f"target.device={args.device}", f"target.dtype={args.dtype}",
        f"extract.dtype={args.dtype}", f"train.device={args.device}", f"train.dtype={train_dtype}",
    ])
    from draftsmith.bench.benchmark import run_benchmark
    from draftsmith.data.merge import run_merge
    from draftsmith.export.fix_keys import run_fix_keys
    from draftsmith.extract.stage import run_extract
    from draftsmith.generate.stage import run_generate
    from draftsmith.serve.deploy import run_deploy
    from draftsmith.train.trainer import run_train

    timings: dict[str, float] = {}
    started = time.perf_counter()
    target = resolve_target(config.target)
    timings["target"] = time.perf_counter() - started
    c, out = config, {}

    def stage(name, fn, *inputs):
        t0 = time.perf_counter()
        plan = plan_stage(c.run_root, name, {"device_run": args.device}, list(inputs))
        out[name] = fn(plan)
        timings[name] = time.perf_counter() - t0
        print(f"== {name}: {timings[name]:.1f}s {out[name].counts} {out[name].figures}",
              flush=True)

    stage("generate", lambda p: run_generate(c.generate, c.data, c.target, target, p), target)
    stage("merge", lambda p: run_merge(c.merge, out["generate"], target, p), out["generate"])
    stage("extract", lambda p: run_extract(c.extract, c.target, out["merge"], target, p),
          out["merge"])
    stage("train", lambda p: run_train(c.train, out["extract"], out["merge"], target, p),
          out["extract"])
    stage("fix_keys", lambda p: run_fix_keys(c.fix_keys, c.target, out["train"], target, p),
          out["train"])
    stage("deploy", lambda p: run_deploy(c.deploy, c.target, out["fix_keys"], out["merge"],
                                         target, p), out["fix_keys"])
    stage("benchmark", lambda p: run_benchmark(c.benchmark, c.target, out["deploy"],
                                               out["merge"], target, p), out["deploy"])
    print(json.dumps({"device": args.device, "dtype": args.dtype,
                      "seconds": {k: round(v, 1) for k, v in timings.items()},
                      "benchmark": out["benchmark"].figures}, indent=2))


if __name__ == "__main__":
    main()
