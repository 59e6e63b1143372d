# Issue 18's side-by-side call: the shared harness (draftsmith + speculators 0.9.0, both
# document lengths, both lm_head modes), then TTT 7 in the same call.
T0=$(date +%s)
PART=spec DEADLINE=440 bash .anchors/side_by_side_train.sh
left=$(( 560 - ($(date +%s) - T0) ))
echo "=== draftsmith TTT 7 (elapsed $(( $(date +%s) - T0 )), $left s left)"
PYTHONPATH=/tmp/site_ds:. timeout -k 5 $left python3 benchmarks/train_throughput.py --tokens 8192 \
  --doc 8192 --ttt 7 --lm-head frozen trainable --iters 10 --warmup 3 --out $OUT/ttt7.jsonl \
  > $OUT/ttt7.log 2>&1
echo "rc=$?"; grep -o '"lm_head": "[a-z]*"\|"tokens_per_s": [0-9]*\|"peak_memory_gib": [0-9.]*' $OUT/ttt7.jsonl | tr '\n' ' '
echo; echo "done elapsed $(( $(date +%s) - T0 ))"
