"""The train stage as `draftsmith run` runs it, on the hidden states of an 8B-shaped target
(issue 18, items 3 and 4): its steady tokens/s (the stage's own figure, past the windows that
compile; compare with the in-memory loop of train_throughput.py), its seconds and GPU peak,
with the compile cache cold and then warm. Each run is a process of its own, as a retry or a
rerun is: `draftsmith run --to train` with train.seed 0 (an empty compile cache), then with
train.seed 1 (another key, so it trains again, with the first run's compile cache); then
`draftsmith compare --to train` tabulates both from their Cached outputs. The target
(random weights) and the data are training_inputs.py's.

    python benchmarks/train_stage.py --root /tmp/stage --tokens 98304 --log-every 4 \\
        --out benchmarks/results/train_stage_h200.jsonl                # on a GPU host
    python benchmarks/train_stage.py --root /tmp/stage-cpu --small --device cpu \\
        --tokens 4096 --doc 256 --batch-tokens 512 --log-every 2      # checks the script
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run by path, not as a package
from training_inputs import CLI, add_arguments, compare_to_train, keep, prepare  # noqa: E402

RUNS = {"cold": "train.seed=0", "warm": "train.seed=1"}  # in this order: the cache fills first


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser, tokens=98304)
    args = parser.parse_args()
    config = prepare(args, "train-stage")
    for name, setting in RUNS.items():
        subprocess.run([*CLI, "run", str(config), "--to", "train", "--set", setting,
                        "--set", f"name=train-stage-{name}"], check=True)
    rows = compare_to_train(config, [f"{name}: {setting}" for name, setting in RUNS.items()])
    keep(args, {"tokens": args.tokens, "doc": args.doc, "rows": rows})


if __name__ == "__main__":
    main()
