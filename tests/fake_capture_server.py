"""A stand-in for an SGLang capture server, started by the extract stage's launcher.

It reads what the launcher gives SGLang: the flags (radix cache and chunked prefill must be
off) and the environment of draftsmith's external model package (architecture, canonical aux
ids, dump directory), builds the SGLang-style Llama of tests/test_extract_sglang.py around the
transformers target, installs the capture exactly as the package does, and serves /generate.
FAKE_CAPTURE_MODE=no_package logs what SGLang's registry logs when the package fails to import
and serves the model without the capture.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from draftsmith.extract.sglang_dump import capture_settings_from_env, install_capture  # noqa: E402
from draftsmith.target import load_target_model  # noqa: E402
from tests.test_extract_sglang import SGLangStyleLlama, StandInServer  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model-path", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--chunked-prefill-size", type=int, required=True)
    p.add_argument("--disable-radix-cache", action="store_true")
    args, _ = p.parse_known_args()
    if not args.disable_radix_cache or args.chunked_prefill_size != -1:
        sys.exit("capture servers need --disable-radix-cache and --chunked-prefill-size -1")
    if os.environ.get("SGLANG_EXTERNAL_MODEL_PACKAGE") != "draftsmith.extract.sglang_models":
        sys.exit("SGLANG_EXTERNAL_MODEL_PACKAGE is not draftsmith's capture package")
    arch, layers, directory = capture_settings_from_env()
    print("flags:", " ".join(sys.argv[1:]), "| architecture:", arch, flush=True)
    model = SGLangStyleLlama(load_target_model(args.model_path))
    if os.environ.get("FAKE_CAPTURE_MODE") == "no_package":
        print("[2026-11-01 10:00:00] Ignore import error when loading "
              "draftsmith.extract.sglang_models.capture_model: No module named 'sgl_kernel'",
              flush=True)
    else:
        install_capture(model, layers, directory)
    time.sleep(0.5)  # the port opens only once the model is ready, as SGLang's does
    with StandInServer(model, "rids", args.host, args.port):
        while True:
            time.sleep(1)


if __name__ == "__main__":
    main()
