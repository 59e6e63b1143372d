"""Online training against extract + offline training, end to end (issue 19, item 5), as the
product compares them: `draftsmith compare --to train`, one variant per mode and epoch count,
each row with its stages' seconds, the GPU peak and the bytes its outputs hold on disk.
Offline variants share one extraction (Cached after the first), whose seconds count in each
of their end-to-end figures; online variants keep no store. A first variant trains 2 steps,
so the compile cache is warm and no figure holds compiling. The target (Llama-3.1-8B's shape,
random weights) and the data are training_inputs.py's.

    python benchmarks/online_vs_offline.py --root /tmp/ovo --tokens 131072 --epochs 1 5 \\
        --out benchmarks/results/online_vs_offline_h200.jsonl          # on a GPU host
    python benchmarks/online_vs_offline.py --root /tmp/ovo-cpu --small --device cpu \\
        --tokens 4096 --doc 256 --batch-tokens 512 --epochs 1 2      # checks the script
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run by path, not as a package
from training_inputs import add_arguments, compare_to_train, keep, prepare  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser, tokens=131072)
    parser.add_argument("--epochs", type=int, nargs="+", default=[1, 5])
    args = parser.parse_args()
    config = prepare(args, "online-vs-offline")
    variants = ["warm: train.mode=offline train.epochs=1 train.max_steps=2"]
    for epochs in args.epochs:
        variants += [f"offline-{epochs}: train.mode=offline train.epochs={epochs}",
                     f"online-{epochs}: train.mode=online train.epochs={epochs}"]
    keep(args, {"tokens": args.tokens, "doc": args.doc,
                "rows": compare_to_train(config, variants)})


if __name__ == "__main__":
    main()
