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

from draftsmith.config import load_config
from draftsmith.plan import run_in_process
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
    timings: dict[str, float] = {}
    started = time.perf_counter()
    target = resolve_target(config.target)
    timings["target"] = time.perf_counter() - started

    def timed(name: str, descriptor, seconds: float) -> None:
        timings[name] = seconds
        print(f"== {name}: {seconds:.1f}s {descriptor.counts} {descriptor.figures}", flush=True)

    out = run_in_process(config, target, after=timed).outputs
    print(json.dumps({"device": args.device, "dtype": args.dtype,
                      "seconds": {k: round(v, 1) for k, v in timings.items()},
                      "benchmark": out["benchmark"].figures}, indent=2))


if __name__ == "__main__":
    main()
