#!/usr/bin/env bash
# Issue 29: the 2-process gloo training jobs (DDP and FSDP, offline and online) run ROUNDS times
# each under torchrun with two CPU burners beside them; the count of aborts (a rank killed by
# SIGABRT at exit) is the figure. Raw output: benchmarks/results/stress_distributed/.
#
# Usage: benchmarks/stress_distributed.sh [ROUNDS] [OUTPUT_NAME]
#   CODE=DIR     test the draftsmith in DIR (e.g. a `git worktree` of an older commit); default
#                this checkout. The driver (benchmarks/stress_distributed.py) is this checkout's.
#   BURNERS=N    CPU burners to start (default 2); TASKSET=CPUS pins burners and training
#                (e.g. TASKSET=0 for one core); MODES=ddp-offline,fsdp-offline,... (default all).
#   SETSID=1     each burner in a session of its own. With the kernel's autogroup scheduling
#                (/proc/sys/kernel/sched_autogroup_enabled) the processes of one session share
#                one CPU share, and torchrun runs in a session of its own: burners started
#                from one shell weigh as one task against it.
#   CORES=1      an aborted rank dumps core; gdb's backtrace of its threads goes into the output.
#   PROBE=1      each rank reports the gloo worker threads it still runs after Dist.close
#                (benchmarks/stress_probe_worker.py).
#   SLOW_EXIT=S  with PROBE=1: rank 1 holds the GIL S seconds in its last exit handler, which
#                widens the window of the abort at exit (benchmarks/stress_probe_worker.py).
#   SUITE=1      a round is CODE's own tests/test_train_loop.py under two pytest-xdist workers,
#                as the suite runs it; every torchrun attempt it logs is counted.
#   PYTHON       the interpreter (default .venv/bin/python).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
rounds=${1:-30}
name=${2:-$(date -u +%Y%m%dT%H%M%SZ)}
code=$(cd "${CODE:-$here}" && pwd)
python=${PYTHON:-$here/.venv/bin/python}
burners=${BURNERS:-2}
pin=(); [ -n "${TASKSET:-}" ] && pin=(taskset -c "$TASKSET")
results=$here/benchmarks/results/stress_distributed
work=$(mktemp -d "${TMPDIR:-/tmp}/stress-distributed.XXXXXX")
mkdir -p "$results"
out=$results/$name.txt

pids=()
stop() {
  for pid in "${pids[@]}"; do kill "$pid" 2> /dev/null || true; done
  rm -rf "$work"
}
trap stop EXIT
own=(); [ -n "${SETSID:-}" ] && own=(setsid)
for _ in $(seq "$burners"); do
  "${own[@]}" "${pin[@]}" python3 -c "while True: pass" &
  pids+=($!)
done

{
  echo "# $(date -u +%FT%TZ) $(nproc) cores, $(free -g | awk '/^Mem/ {print $2}') GiB;" \
       "$burners burners${SETSID:+, each in its own session}${TASKSET:+, pinned to CPU $TASKSET};" \
       "autogroup $(cat /proc/sys/kernel/sched_autogroup_enabled 2> /dev/null || echo n/a); code $code at" \
       "$(git -C "$code" rev-parse --short HEAD);${SLOW_EXIT:+ rank 1 holds the GIL $SLOW_EXIT s at exit;} load average $(cut -d' ' -f1-3 /proc/loadavg)"
  # faulthandler prints every Python thread's stack when a rank dies by SIGABRT; not with
  # SUITE=1, which runs the tests as the suite does.
  faulthandler=1; [ -n "${SUITE:-}" ] && faulthandler=
  STRESS_SLOW_EXIT=${SLOW_EXIT:-} PYTHONPATH=$code PYTHONFAULTHANDLER=$faulthandler PREFECT_SERVER_ANALYTICS_ENABLED=false \
    "${pin[@]}" "$python" "$here/benchmarks/stress_distributed.py" --rounds "$rounds" \
    ${MODES:+--modes "$MODES"} ${CORES:+--cores} ${PROBE:+--probe} ${SUITE:+--suite} --work "$work" --keep "$results/$name-logs" 2>&1 \
    | grep --line-buffered -v -e "it/s]" -e "^Loading weights" -e "^Writing model shards"
  echo "# load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
} | tee "$out"
