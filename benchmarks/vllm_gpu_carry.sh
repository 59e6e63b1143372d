#!/usr/bin/env bash
# Makes the folders benchmarks/vllm_gpu.sh carries to the device: vLLM 0.26.0 for Hopper and
# the wheels it needs that the device image lacks. Run here (it downloads from the package
# registry); WORK keeps the downloads (about 1 GB while it runs).
#   PATH=.venv/bin:$PATH bash benchmarks/vllm_gpu_carry.sh [WORK]
set -eu
WORK=${1:-/tmp/vllm_gpu}
REPO=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$WORK" && cd "$WORK"
platforms=()
for v in 39 38 35 34 31 28 27 24 17 5; do platforms+=(--platform "manylinux_2_${v}_x86_64"); done
platforms+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
target=(--only-binary=:all: "${platforms[@]}" --python-version 3.12)

pip download vllm==0.26.0 --no-deps "${target[@]}" -d .
wheel=$(ls vllm-0.26.0-*.whl)
# vLLM's requirements, less torch and its CUDA libraries (the image's), the GPU kernel
# packages that only some paths import, and what the image has.
unzip -p "$wheel" vllm-0.26.0.dist-info/METADATA | sed -n 's/^Requires-Dist: //p' \
  | grep -v "extra ==" | grep -v -E "^(torch|torchaudio|torchvision|torchcodec|PyNvVideoCodec\
|flashinfer-python|apache-tvm-ffi|tilelang|nvidia-cudnn-frontend|nvtx|fastsafetensors\
|nvidia-cutlass-dsl|quack-kernels|tokenspeed-mla|humming-kernels|numba|opencv-python-headless\
|transformers|tokenizers|safetensors|numpy|pillow|ninja)\b" > reqs.txt
pip install --dry-run --ignore-installed --quiet --report report.json "${target[@]}" \
  --target "$WORK/resolve" -r reqs.txt
# The image's packages, as the device README lists them (KINDS.md).
grep -m1 "Packages: absl-py" "$REPO"/../.library/device/KINDS.md | sed 's/.*Packages: //' \
  | tr ',' '\n' | sed 's/^ *//; s/\.$//' | tr 'A-Z_' 'a-z-' | sort -u > image_pkgs.txt
python3 - <<'PY'
import json, re
image = set(open("image_pkgs.txt").read().split())
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
missing = sorted(f"{norm(i['metadata']['name'])}=={i['metadata']['version']}"
                 for i in json.load(open("report.json"))["install"]
                 if norm(i["metadata"]["name"]) not in image
                 and not norm(i["metadata"]["name"]).startswith(("nvidia-", "cuda-"))
                 and norm(i["metadata"]["name"]) not in {"torch", "triton", "setuptools"})
open("missing.txt", "w").write("\n".join(missing) + "\n")
print(len(missing), "wheels the image lacks")
PY
rm -rf deps && pip download --no-deps "${target[@]}" -d deps -r missing.txt
# vLLM unpacked, less FlashAttention 2 (Hopper runs FlashAttention 3; the FA2 import is
# optional) and deep_gemm's builds for the other Pythons.
rm -rf tree && mkdir tree && (cd tree && unzip -q "../$wheel")
rm -f tree/vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so \
  tree/vllm/third_party/deep_gemm/_C.cpython-31{0,1,3,4}-x86_64-linux-gnu.so
tar cf - -C tree . | xz -T0 -6 | split -b 45M - vllm.tar.xz.part_
n=0
for part in vllm.tar.xz.part_*; do
  n=$((n + 1)); rm -rf "$REPO/.gpu/v$n" && mkdir -p "$REPO/.gpu/v$n" && cp "$part" "$REPO/.gpu/v$n/"
done
# The wheels in folders of at most 40 MiB (a call carries 64 MiB with the repository), each
# under vd/, so that on the device they stay apart from the Prefect wheels that `keep` puts
# beside them (a few of the same packages at other versions).
rm -rf "$REPO"/.gpu/vd*
folder=1 size=0
for whl in deps/*.whl; do
  bytes=$(stat -c %s "$whl")
  if [ $((size + bytes)) -gt $((40 << 20)) ]; then folder=$((folder + 1)); size=0; fi
  mkdir -p "$REPO/.gpu/vd$folder/vd" && cp "$whl" "$REPO/.gpu/vd$folder/vd/"
  size=$((size + bytes))
done
du -sh "$REPO"/.gpu/v*
