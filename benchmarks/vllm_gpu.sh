#!/usr/bin/env bash
# vLLM 0.26.0 (the newest vLLM for the device image's torch 2.11) on a lent H200, carried in
# pieces, for issue 46's GPU rows. NOT RUN YET: what is known is in benchmarks/README.md
# ("vLLM on the GPU: the carry prepared").
# What travels (ignored by git; benchmarks/vllm_gpu_carry.sh makes them here):
#   .gpu/v1 .. .gpu/vN  vllm-0.26.0 unpacked for Hopper (no FlashAttention-2 kernels, no
#                       other Pythons' deep_gemm builds), as tar.xz parts of <= 45 MiB
#   .gpu/vd1, .gpu/vd2  the 86 wheels vLLM needs that the image lacks (fastapi, openai,
#                       msgspec, pyzmq, xgrammar, llguidance, ...), versions resolved for
#                       Python 3.12 on manylinux, in folders of at most 40 MiB
# Calls, each as soon as the last returned (a machine idle for 30 s goes back):
#   carry .gpu/vK:  bash benchmarks/h200_run.sh keep vK      (for each K, then vd1, vd2)
#   then:           bash benchmarks/vllm_gpu.sh install
#      unpacks vLLM and installs the wheels into /tmp/vsite (its own site: the Prefect
#      wheels of .gpu/w pin other fastapi and pydantic versions), imports vllm and prints
#      `vllm serve --help`'s speculative flags; what fails to import is the next wheel to carry
#   then:           bash benchmarks/vllm_gpu.sh serve TARGET_DIR [DRAFTER_DIR]
#      starts `vllm serve` on the target (and the drafter, EAGLE-3 from its speculators
#      config), asks for one greedy completion and prints vLLM's spec-decode counters.
set -u
cmd=${1:?install or serve}; shift
KEEP=/tmp/keep
VSITE=/tmp/vsite
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

case "$cmd" in
  install)
    { mkdir -p "$VSITE"
      cat "$KEEP"/vllm.tar.xz.part_* | xz -d | tar xf - -C "$VSITE" && echo "vllm unpacked"
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --target "$VSITE" "$KEEP"/vd/*.whl 2>&1 | tail -3
      # /tmp/vsite holds only what the image lacks: nothing of the image's is shadowed
      PYTHONPATH="$VSITE" python3 -c "import vllm, torch; print('vllm', vllm.__version__, \
'torch', torch.__version__, torch.cuda.get_device_name())" 2>&1 | tail -5
      PYTHONPATH="$VSITE" python3 -m vllm.entrypoints.cli.main serve --help=all 2>&1 \
        | grep -E -A3 "speculative-config|--max-num-seqs" | head -20
    } | tee "$OUT"/install.txt
    ;;
  serve)
    target=${1:?target dir}; drafter=${2:-}
    spec=()
    [ -n "$drafter" ] && spec=(--speculative-config \
      "{\"method\": \"eagle3\", \"model\": \"$drafter\", \"num_speculative_tokens\": 3}")
    PYTHONPATH="$VSITE" setsid nohup python3 -m vllm.entrypoints.cli.main serve "$target" \
      --host 127.0.0.1 --port 30200 --dtype float32 --max-model-len 2048 "${spec[@]}" \
      > /tmp/vllm_serve.log 2>&1 < /dev/null &
    for _ in $(seq 120); do
      curl -sf http://127.0.0.1:30200/health >/dev/null && break; sleep 2
    done
    curl -s http://127.0.0.1:30200/v1/completions -H 'Content-Type: application/json' \
      -d '{"model": "'"$target"'", "prompt": "def fibonacci(n):", "max_tokens": 64, "temperature": 0}' \
      | tee "$OUT"/completion.json
    curl -s http://127.0.0.1:30200/metrics | grep -E "spec_decode" | head -20 | tee "$OUT"/metrics.txt
    tail -c 200000 /tmp/vllm_serve.log > "$OUT"/vllm_serve.log
    ;;
esac
