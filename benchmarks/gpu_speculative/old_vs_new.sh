#!/usr/bin/env bash
# The static path's step costs (attention_variants.py: random SmolLM2-shaped parts, a plain
# token and a round's draft / verify / other) in this tree and in an older one, side by side in
# one device call: both trees compile at once and take turns on the GPU (one lock file), so
# neither has the machine to itself while the other compiles.
#
# Carry two folders, ignored by git:
#   .gpu/old  the older tree: git archive REV draftsmith benchmarks/gpu_speculative \
#               benchmarks/*.py pyproject.toml | tar -x -C .gpu/old
#   .gpu/p    pydantic's wheels (the device image lacks it; benchmarks/h200_wheels.sh puts them
#               in .gpu/w: annotated_types, pydantic, pydantic_core, typing_inspection)
# then, on the device (results under $OUT/old and $OUT/new, a JSON line per run):
#   bash benchmarks/gpu_speculative/old_vs_new.sh SECONDS --variants bf16:decode
# Every argument after SECONDS goes to attention_variants.py in both trees; name each variant
# once (a tree before 826ec00 waited for a repeated variant's last run only). Each run compiles
# its own steps: one run of each tree took more than 170 s on an H100 when four compiled at
# once (2026-12-06), so give one run a tree 400 s or more.
# Here, a check: OUT=/tmp/ovn DEVICE=cpu bash benchmarks/gpu_speculative/old_vs_new.sh 900 \
#   --variants decode --prompts 1 --max-new-tokens 4
set -u
limit=${1:?seconds each tree may run}; shift
out=${OUT:?where the results go}
device=${DEVICE:-cuda}
python=${PYTHON:-python3}
[ -d .gpu/old/draftsmith ] || { echo ".gpu/old holds no tree: see this script's header"; exit 2; }
if ! "$python" -c "import pydantic" 2>/dev/null; then
  "$python" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/p/*.whl \
    || { echo "pydantic's wheels did not install from .gpu/p"; exit 2; }
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
mkdir -p "$out"/old "$out"/new
# attention_variants.py locks its --out with the suffix .lock: one file for both trees.
ln -sf "$out"/new/runs.lock "$out"/old/runs.lock
script=benchmarks/gpu_speculative/attention_variants.py
(cd .gpu/old && timeout "$limit" "$python" "$script" --device "$device" "$@" \
   --out "$out"/old/runs.jsonl > "$out"/old/log.txt 2>&1; echo "old: rc $?") &
timeout "$limit" "$python" "$script" --device "$device" "$@" --out "$out"/new/runs.jsonl \
  > "$out"/new/log.txt 2>&1
echo "new: rc $?"
wait
rm -f "$out"/old/runs.lock "$out"/new/runs.lock
for tree in old new; do
  echo "--- $tree"
  if [ -s "$out/$tree/runs.jsonl" ]; then
    "$python" -c "import json, sys
for line in open(sys.argv[1]):
    row = json.loads(line)
    print(json.dumps({k: v for k, v in row.items() if k != 'plain_tokens'}))" \
      "$out/$tree/runs.jsonl"
  else
    grep -v Warning "$out/$tree/log.txt" | tail -5
  fi
done
