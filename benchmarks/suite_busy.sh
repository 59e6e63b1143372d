#!/usr/bin/env bash
# The README's test command (.ci/run) on a fresh clone, with CPU burners beside it the whole
# time: the suite on a busy machine (issue 29). Raw output, headed by the commit, the burners
# and the load: benchmarks/results/suite_time/busy_ci_<commit>_<run>.txt.xz, and each test's
# worker, time and CPU beside it (.timeline.jsonl.xz, summed by worker and module by
# benchmarks/suite_timeline.py into .timeline.summary.txt). The clone and its venv are deleted
# afterwards.
#
# Usage: benchmarks/suite_busy.sh [RUNS] [BURNERS]   (default 2 runs in a row, 2 burners)
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
runs=${1:-2}
burners=${2:-2}
commit=$(git -C "$here" rev-parse --short HEAD)
results=$here/benchmarks/results/suite_time
mkdir -p "$results"

pids=()
clone=""
stop() {
  for pid in "${pids[@]}"; do kill "$pid" 2> /dev/null || true; done
  [ -n "$clone" ] && rm -rf "$clone"
}
trap stop EXIT
for _ in $(seq "$burners"); do
  python3 -c "while True: pass" &
  pids+=($!)
done

for run in $(seq "$runs"); do
  clone=$(mktemp -d "${TMPDIR:-/tmp}/ci-busy.XXXXXX")
  git clone -q "$here" "$clone"
  git -C "$clone" checkout -q "$commit"
  out=$results/busy_ci_${commit}_${run}.txt
  rm -f "${out%.txt}.timeline.jsonl" "${out%.txt}.timeline.jsonl.xz"
  export DRAFTSMITH_SUITE_TIMELINE=${out%.txt}.timeline.jsonl
  {
    echo "# .ci/run on a fresh clone of $commit ($clone), run $run of $runs in a row, $burners" \
         "CPU burners (python3 -c 'while True: pass') throughout; $(date -u +%FT%TZ);" \
         "$(nproc) cores; load average $(cut -d' ' -f1-3 /proc/loadavg); $(df -h --output=avail /tmp | tail -1 | tr -d ' ') free in /tmp"
    started=$(date +%s)
    set +e
    (cd "$clone" && .ci/run) 2>&1
    rc=$?
    set -e
    echo "# exit code $rc; .ci/run took $(( $(date +%s) - started )) s (install, ruff, docs and the suite); load average after $(cut -d' ' -f1-3 /proc/loadavg)"
  } > "$out"
  tail -n 3 "$out"
  timeline=${out%.txt}.timeline.jsonl
  python3 "$here/benchmarks/suite_timeline.py" "$timeline" > "${timeline%.jsonl}.summary.txt"
  xz -9 -f "$out" "$timeline"
  rm -rf "$clone"
  clone=""
done
