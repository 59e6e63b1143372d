"""Check run_quality's replay of chain decoding against the benchmark, on the CPU demo.

Runs examples/tiny.yaml's stages (the demo: tiny target, TTT 3, benchmark 16 prompts x 64
tokens), then run_quality.tau_by_position on the trained drafter and run_quality.walk_vs_benchmark
on the benchmark's prompts. The replay counts the rounds and tokens that greedy chain decoding
makes over the stored answers; on the demo it equals the measured rounds and tokens prompt by
prompt, while tau over the same 64 answer tokens is higher. About two minutes on two cores:

    python benchmarks/quality/replay_check.py --run-root /tmp/replay-check
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import run_quality  # noqa: E402

from draftsmith.config import load_config  # noqa: E402
from draftsmith.logs import configure_logging  # noqa: E402
from draftsmith.target import resolve_target  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny.yaml"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-root", type=Path, required=True)
    args = parser.parse_args(argv)
    configure_logging()
    config = load_config(EXAMPLE, [f"run_root={args.run_root.resolve()}"])
    tokens = config.benchmark.max_new_tokens
    state: dict = {}

    def after(stage: str, outputs: dict, seconds: dict) -> None:
        if stage == "train":
            state["positions"] = run_quality.tau_by_position(
                config, outputs, [tokens, config.generate.max_new_tokens])
        if stage == "benchmark":
            state["bench"] = run_quality.walk_vs_benchmark(state["positions"], outputs, tokens)

    run_quality.run_stages(config, resolve_target(config.target), after)
    positions, bench = state["positions"], state["bench"]
    summary = {
        "tau": {k: v["tau"] for k, v in positions["tau"].items()},
        "train_stage_tau": positions["train_stage_tau"],
        "replay_all_validation": {k: v["acceptance"] for k, v in positions["walk"].items()},
        "benchmark": {k: v for k, v in bench.items() if k != "per_prompt"},
        "prompts_with_equal_rounds": sum(p["walk_rounds"] == p["rounds"]
                                         for p in bench["per_prompt"]),
    }
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    sys.exit(main())
