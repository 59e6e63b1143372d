"""How long a cached re-run of the demo takes, and where the time goes.

    python benchmarks/cached_rerun.py [--run-root runs/demo] [--runs 5]

Runs `draftsmith demo` once to make sure every stage is complete (that first run may take
minutes), then `--runs` more times, each a fresh process as a user starts it. Prints per run the
1-minute load average before it, the wall time, and three phases read off the run's log:
until the flow's first line (imports, config, the temporary Prefect API server), the flow
itself, and the exit (the server stops). The machine is shared: quote the load with the figure.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

DRAFTSMITH = Path(sys.executable).parent / "draftsmith"
STAMP = re.compile(r"^(\d\d:\d\d:\d\d\.\d{3}) \|")


def clock(line: str, day: datetime) -> float | None:
    match = STAMP.match(line)
    if not match:
        return None
    moment = datetime.strptime(match.group(1), "%H:%M:%S.%f").replace(
        year=day.year, month=day.month, day=day.day)
    return moment.timestamp()


def one_run(run_root: Path) -> dict:
    load = os.getloadavg()[0]
    day = datetime.now()
    started = time.time()
    proc = subprocess.run([str(DRAFTSMITH), "demo", "--run-root", str(run_root)],
                          capture_output=True, text=True)
    ended = time.time()
    if proc.returncode != 0:
        raise SystemExit(proc.stdout[-2000:] + proc.stderr[-3000:])
    stamps = [t for line in (proc.stdout + proc.stderr).splitlines()
              if (t := clock(line, day)) is not None]
    states = re.findall(r"│ \S+ +│ (\w+) +│", proc.stdout)
    return {"load_1min": round(load, 2), "wall_s": round(ended - started, 2),
            "until_flow_s": round(stamps[0] - started, 2) if stamps else None,
            "flow_s": round(stamps[-1] - stamps[0], 2) if stamps else None,
            "exit_s": round(ended - stamps[-1], 2) if stamps else None,
            "states": sorted(set(states))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-root", type=Path, default=Path("runs/demo"))
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    one_run(args.run_root)  # complete every stage (and remember the input digests)
    results = [one_run(args.run_root) for _ in range(args.runs)]
    for result in results:
        print(json.dumps(result))
    walls = sorted(r["wall_s"] for r in results)
    print(json.dumps({"runs": len(walls), "median_wall_s": walls[len(walls) // 2],
                      "min_wall_s": walls[0], "cpus": os.cpu_count()}))


if __name__ == "__main__":
    main()
