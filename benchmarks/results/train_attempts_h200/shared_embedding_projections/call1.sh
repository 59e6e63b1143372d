set -u
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
left() { echo $(( 570 - $(el) )); }
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site_ds .anchors/.whl_ds/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site_ds:. PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/inductor_ab
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > $OUT/env.txt
python3 -c "import torch,transformers;print(torch.__version__, transformers.__version__)" >> $OUT/env.txt
tp() { # label dir args...
  local label=$1 dir=$2; shift 2
  [ "$(left)" -lt 40 ] && { echo "skip $label"; return; }
  echo "=== $label (elapsed $(el))"
  (cd $dir && PYTHONPATH=/tmp/site_ds:. timeout -k 5 "$(left)" python3 benchmarks/train_throughput.py --tokens 8192 --iters 10 --warmup 3 --ttt 3 --lm-head frozen --out $OUT/$label.jsonl "$@" > $OUT/$label.log 2>&1); echo "rc=$?"; grep -o '"tokens_per_s": [0-9]*\|"peak_memory_gib": [0-9.]*\|"warmup_s": [0-9.]*' $OUT/$label.jsonl | tr '\n' ' '; echo
}
echo "=== attention check flex (elapsed $(el))"
(cd .wt_speed && timeout 120 python3 -m draftsmith.model.attention_check --device cuda --path flex > $OUT/check_flex.log 2>&1; echo rc=$?; tail -3 $OUT/check_flex.log)
tp shared_doc8192 .wt_speed --doc 8192
tp shared_doc2048 .wt_speed --doc 2048
tp base_doc8192 . --doc 8192
tp base_doc2048 . --doc 2048
echo "=== attention check cudnn (elapsed $(el))"
(cd .wt_speed && timeout 120 python3 -m draftsmith.model.attention_check --device cuda --path cudnn > $OUT/check_cudnn.log 2>&1; echo rc=$?; tail -3 $OUT/check_cudnn.log)
tp shared_cudnn_doc8192 .wt_speed --doc 8192 --attention cudnn
tp shared_doc2048_again .wt_speed --doc 2048
tp shared_doc8192_again .wt_speed --doc 8192
echo "done elapsed $(el)"
