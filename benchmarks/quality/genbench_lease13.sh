cat /tmp/smollm/part_aa .gpu/b/part_ab > /tmp/smollm/smollm2.gguf
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .anchors/.whl_ds/*.whl .gpu/b/whl/*.whl >/dev/null 2>&1 || echo "deps failed"
PYTHONPATH=/tmp/site DRAFTSMITH_CACHE=/tmp/dc DRAFTSMITH_SMOLLM2_GGUF=/tmp/smollm/smollm2.gguf HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false timeout 480 python3 benchmarks/generation_speed.py --out $OUT/h200_lease13.jsonl --only dynamic-fp32-b256 static-fp32-b256-buckets dynamic-bf16-b512 static-bf16-b2048-12k-buckets-prefill --deadline-s 210 > $OUT/h200_lease13.log 2>&1
echo rc $?; grep -E "generation_speed" $OUT/h200_lease13.log | tail -25 | cut -c1-160
