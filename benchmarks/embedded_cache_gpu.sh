#!/usr/bin/env bash
# The embedded engine's two target caches on a lent GPU (the device tool), through
# `draftsmith run` under Prefect as the product runs: the whole pipeline once on CONFIG with
# target.device=cuda, then its benchmark stage again and again, alternating
# deploy.embedded_cache dynamic and static, REPEATS pairs. Each benchmark's report.json comes
# back as $OUT/report-<cache>-<i>.json (ms per plain token, ms per round: draft, verify,
# other; acceptance, speedup, speedup_limit, identical).
#   carry .gpu/w (benchmarks/h200_wheels.sh):
#   bash benchmarks/embedded_cache_gpu.sh examples/tiny.yaml 2
set -u
config=${1:?config}; repeats=${2:-2}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
  .gpu/w/*.whl >/dev/null 2>&1 || echo "wheel install failed"
export PYTHONPATH=/tmp/site:$PWD DRAFTSMITH_CACHE=/tmp/cache PREFECT_HOME=/tmp/prefect \
  PREFECT_SERVER_ANALYTICS_ENABLED=false HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false \
  PYTHONUNBUFFERED=1
root=/tmp/ecache/root
run() {  # run CACHE: the pipeline (cached stages skipped) with this target cache
  python3 -m draftsmith.cli run "$config" --set run_root=$root --set target.device=cuda \
    --set deploy.embedded_cache="$1" >> "$OUT"/run.log 2>&1
  echo "$1 rc=$?"
}
python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__, \
torch.cuda.get_device_name())" | tee "$OUT"/versions.txt
for i in $(seq 1 "$repeats"); do
  for cache in dynamic static; do
    rm -rf $root/benchmark
    start=$(date +%s); run $cache; echo "  $(( $(date +%s) - start )) s"
    cp $root/benchmark/*/report.json "$OUT/report-$cache-$i.json" 2>/dev/null
    python3 - "$OUT/report-$cache-$i.json" <<'EOF'
import json, sys
try:
    s = json.load(open(sys.argv[1]))["summary"]
except (OSError, KeyError) as err:
    sys.exit(f"  no report: {err}")
print("  " + json.dumps({k: s.get(k) for k in ("acceptance_length", "speedup", "speedup_limit",
      "ms_per_plain_token", "ms_per_round", "identical_outputs")}))
EOF
  done
done
grep -E "Error|Traceback|recompil" "$OUT"/run.log | tail -20
