#!/usr/bin/env bash
# Seconds from launch to /health for vLLM (CPU) serving SmolLM2-135M-Instruct, in vLLM's default
# layout and with VLLM_ENABLE_V1_MULTIPROCESSING=0 (what the test suite's servers use:
# tests/vllm_chain.py), alternating. Usage: benchmarks/vllm_startup/run.sh MODEL_DIR [ROUNDS]
# MODEL_DIR: the converted target, e.g. $DRAFTSMITH_CACHE/smollm2-135m-instruct-v2.
set -euo pipefail
model=$1; rounds=${2:-2}
python=${PYTHON:-.venv/bin/python}
echo "# $(date -u +%FT%TZ) $(nproc) cores, load average $(cut -d' ' -f1-3 /proc/loadavg)"
for round in $(seq "$rounds"); do
  for mode in default single-process; do
    port=$(( 31000 + RANDOM % 1000 ))
    extra=(); [ "$mode" = single-process ] && extra=(VLLM_ENABLE_V1_MULTIPROCESSING=0)
    start=$(date +%s.%N)
    env "${extra[@]}" VLLM_CPU_KVCACHE_SPACE=1 setsid "$python" -m vllm.entrypoints.launchers.api_server.entry \
      --model "$model" --host 127.0.0.1 --port "$port" --enforce-eager --max-num-seqs 8 \
      --dtype float32 > "/tmp/vllm_startup_$mode.log" 2>&1 &
    pid=$!
    until curl -sf "http://127.0.0.1:$port/health" > /dev/null; do
      kill -0 "$pid" 2> /dev/null || { echo "vLLM exited: /tmp/vllm_startup_$mode.log"; exit 1; }
      sleep 0.2
    done
    echo "round $round $mode: ready after $(echo "$(date +%s.%N) - $start" | bc | cut -c1-5) s"
    kill -TERM -- "-$pid"; wait "$pid" || true
  done
done
echo "# load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
