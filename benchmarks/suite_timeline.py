"""Where a test run's time went, from the lines DRAFTSMITH_SUITE_TIMELINE=FILE makes the suite
write (tests/conftest.py): each worker's busy span and its modules' wall and CPU seconds (the
CPU of a worker's children counts when they are reaped, so a module that stops a long-lived
server is charged that server's CPU).

    python benchmarks/suite_timeline.py benchmarks/results/suite_time/FILE.timeline.jsonl.xz

The kept timelines are xz-compressed, each with this summary beside it (.timeline.summary.txt).
"""

from __future__ import annotations

import argparse
import json
import lzma
from collections import defaultdict
from pathlib import Path


def summarize(lines: list[dict], top: int = 15) -> str:
    began = min(r["start"] for r in lines)
    out = []
    for worker in sorted({r["worker"] for r in lines}):
        rows = [r for r in lines if r["worker"] == worker]
        ended = max(r["start"] + r["seconds"] for r in rows) - began
        out.append(f"{worker}: {len(rows)} tests, done at {ended:.0f} s, "
                   f"{sum(r['seconds'] for r in rows):.0f} s in tests, "
                   f"{sum(r['cpu_s'] for r in rows):.0f} CPU-s")
    modules: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0.0])
    for r in lines:
        figures = modules[(r["worker"], r["test"].split("::")[0])]
        figures[0] += r["seconds"]
        figures[1] += r["cpu_s"]
    out.append(f"{'worker':6s} {'module':44s} {'wall s':>7s} {'CPU s':>7s}")
    for (worker, module), (wall, cpu) in sorted(modules.items(), key=lambda m: -m[1][0])[:top]:
        out.append(f"{worker:6s} {module:44s} {wall:7.0f} {cpu:7.0f}")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("timeline", type=Path)
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()
    opener = lzma.open if args.timeline.suffix == ".xz" else open
    with opener(args.timeline, "rt") as f:
        lines = [json.loads(line) for line in f if line.strip()]
    print(summarize(lines, args.top))


if __name__ == "__main__":
    main()
