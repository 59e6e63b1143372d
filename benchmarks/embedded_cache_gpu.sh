#!/usr/bin/env bash
# The embedded engine's two target caches on a lent GPU (the device tool), through
# `draftsmith run` under Prefect as the product runs: CONFIG's pipeline (its finished stages
# cached under RUN_ROOT), then its benchmark stage again and again, alternating
# deploy.embedded_cache dynamic and static, REPEATS pairs. Each benchmark's report.json comes
# back as $OUT/report-<cache>-<i>.json (ms per plain token, ms per round: draft, verify,
# other; acceptance, speedup, speedup_limit, identical outputs; and the same per batch size,
# BATCHES, default [4,16], in `batched`), the run's log as $OUT/cache-run.log.
#   carry .gpu/w (benchmarks/h200_wheels.sh), then
#   bash benchmarks/embedded_cache_gpu.sh examples/tiny.yaml 2
# After h200_run.sh on the same machine, its run root and target are reused:
#   RUN_ROOT=/tmp/run/root bash benchmarks/embedded_cache_gpu.sh examples/smollm2-h200.yaml 1 \
#     --set benchmark.prompts_per_set=10
# DEVICE=cpu runs the same on the CPU (a check of this script; no figure to keep).
set -u
config=${1:?config}; repeats=${2:-2}; shift 2
extra=("$@")
root=${RUN_ROOT:-/tmp/ecache/root}
device=${DEVICE:-cuda}
batches=${BATCHES:-[4,16]}
OUT=${OUT:-/tmp/ecache/out}
mkdir -p "$OUT"
if ! python3 -c "import prefect" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    .gpu/w/*.whl >/dev/null 2>&1 || echo "wheel install failed"
  export PYTHONPATH=/tmp/site:$PWD
fi
[ -f /tmp/smollm2.gguf ] && export DRAFTSMITH_SMOLLM2_GGUF=/tmp/smollm2.gguf  # h200_run.sh's
export DRAFTSMITH_CACHE=${DRAFTSMITH_CACHE:-/tmp/cache} PREFECT_HOME=${PREFECT_HOME:-/tmp/prefect} \
  PREFECT_SERVER_ANALYTICS_ENABLED=false HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false \
  PYTHONUNBUFFERED=1
python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__, \
torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')" | tee "$OUT"/versions.txt
for i in $(seq 1 "$repeats"); do
  for cache in dynamic static; do
    rm -rf "$root"/benchmark  # the stage runs again, the earlier stages stay cached
    start=$(date +%s)
    python3 -m draftsmith.cli run "$config" --set run_root="$root" --set target.device="$device" \
      --set deploy.embedded_cache=$cache --set "benchmark.batch_sizes=$batches" "${extra[@]}" \
      >> "$OUT"/cache-run.log 2>&1
    echo "$cache $i: rc=$? in $(( $(date +%s) - start )) s"
    cp "$root"/benchmark/*/report.json "$OUT/report-$cache-$i.json" 2>/dev/null
    python3 - "$OUT/report-$cache-$i.json" <<'EOF'
import json, sys
try:
    report = json.load(open(sys.argv[1]))
except OSError as err:
    sys.exit(f"  no report: {err}")
for s in [{"batch": 1, **report["summary"]}, *report.get("batched", [])]:
    print("  " + json.dumps({k: s.get(k) for k in ("batch", "acceptance_length", "speedup",
          "speedup_limit", "ms_per_plain_token", "ms_per_round", "identical_outputs")}))
EOF
  done
done
grep -E "Error|Traceback|recompil" "$OUT"/cache-run.log | tail -20
