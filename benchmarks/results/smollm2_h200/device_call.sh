# Issue 21's H200 run: three data sizes, speculators 0.9.0 on the largest size's store.
set -u
T0=$(date +%s)
cat /tmp/smollm/part_aa .wt_q/part_ab > /tmp/smollm/smollm2.gguf && sha256sum /tmp/smollm/smollm2.gguf
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site_q .anchors/.whl_ds/*.whl .wt_q/*.whl >/dev/null 2>&1 || echo "deps install failed"
PYTHONPATH=/tmp/site_q python3 .anchors/speculators/pick_wheels.py .anchors/.whl_spec > /tmp/picked.txt 2>/dev/null
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site_q $(cat /tmp/picked.txt) >/dev/null 2>&1 || echo "speculators install failed"
echo "installed (elapsed $(( $(date +%s) - T0 )))"
PYTHONPATH=/tmp/site_q:. PYTHONUNBUFFERED=1 timeout -k 5 $(( 585 - ($(date +%s) - T0) )) \
  python3 benchmarks/quality/smollm2_h200.py --out /tmp/q --report-dir $OUT \
  --gguf /tmp/smollm/smollm2.gguf --sizes 500 1000 2000 --speculators \
  --deadline-s 300 --speculators-deadline-s 420 > $OUT/log.txt 2>&1
echo "rc=$? elapsed $(( $(date +%s) - T0 ))"
grep -E "Completed in|benchmark: acceptance|side by side|tau" $OUT/log.txt | tail -30
