"""Export, import, detect and inspect drafter checkpoints.

Layouts: draftsmith native (draftsmith.json + drafter.safetensors, any kind); EAGLE-3 in the
SGLang / EAGLE / SpecForge layout (LlamaForCausalLMEagle3, `midlayer.*`) and the speculators /
vLLM one (Eagle3Speculator, `layers.0.*`); DFlash in the speculators / vLLM layout
(`speculators_model_type: dflash`). Every write is validated against the layout's description
after it lands on disk.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from pydantic import ValidationError
from safetensors.torch import save_file

from draftsmith.artifacts import atomic_path, atomic_write_json, tensor_bytes
from draftsmith.export import native
from draftsmith.export.formats import (
    OPTIONAL_TENSORS,
    SGLANG,
    ExportError,
    Layout,
    all_layouts,
    layout_named,
)
from draftsmith.export.layer_ids import LayerIdError, engine_layer_ids
from draftsmith.export.validate import tensor_problems
from draftsmith.model.kinds import DrafterShape, build_drafter, kind_of

WEIGHTS_FILE = "model.safetensors"
# What to do about a damaged drafter in an engine's layout: it came from elsewhere or from export.
REFETCH = ("re-download it (or copy it again), or write it again with `draftsmith export` from "
           "the native checkpoint")


@dataclass
class DrafterCheckpoint:
    """A drafter read from any layout, in draftsmith's names and canonical layer ids."""

    layout: str  # native, sglang, specforge, speculators
    config: DrafterShape  # Eagle3Config or DFlashConfig
    tensors: dict[str, torch.Tensor]  # native names; embed_tokens only if the files had it
    raw_config: dict[str, Any] = field(default_factory=dict)

    @property
    def kind(self) -> str:
        """The drafter kind (draftsmith/model/registry.py): eagle3 or dflash."""
        return kind_of(self.config).name


def read_weight_files(directory: Path, fix: str = REFETCH) -> dict[str, torch.Tensor]:
    files = sorted(directory.glob("*.safetensors"))
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(native.read_safetensors(f, fix))
    if not files:
        for f in sorted(directory.glob("pytorch_model*.bin")):  # the EAGLE repository's files
            try:
                state = torch.load(f, map_location="cpu", weights_only=True)
            except Exception as err:  # noqa: BLE001 - pickle, zip and torch errors alike
                raise ExportError(f"{f}: not a readable PyTorch weight file "
                                  f"({type(err).__name__}: {err}); it is truncated or damaged: "
                                  f"{fix}") from None
            if not isinstance(state, dict):
                raise ExportError(f"{f}: holds a {type(state).__name__}, expected a state dict "
                                  "of tensors")
            tensors.update(state)
    if not tensors:
        raise ExportError(f"{directory}: no *.safetensors or pytorch_model*.bin weight files")
    return tensors


def detect_layout(directory: str | Path) -> str:
    """native, sglang, specforge or speculators (of any kind: see _layout_in)."""
    directory = Path(directory)
    if (directory / native.META_FILE).is_file():
        return "native"
    layout = _layout_in(directory)
    if layout is SGLANG and _has_embedding(directory):
        return "specforge"  # the SGLang layout plus the embedding SpecForge saves
    return layout.name


def _layout_in(directory: Path) -> Layout:
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise ExportError(f"{directory}: neither {native.META_FILE} (draftsmith native) nor "
                          "config.json (SGLang/EAGLE/SpecForge/speculators) is there")
    config = native.read_json_file(config_path, REFETCH)
    for layout in all_layouts():
        if layout.is_layout_of(config):
            return layout
    raise ExportError(f"{config_path}: architectures {config.get('architectures')} is no "
                      "drafter layout draftsmith knows (EAGLE-3: LlamaForCausalLMEagle3, "
                      "Eagle3Speculator; DFlash: speculators_model_type dflash)")


def _has_embedding(directory: Path) -> bool:
    return any("embed_tokens.weight" in native.safetensors_keys(f, REFETCH)
               for f in directory.glob("*.safetensors"))


def read_drafter(directory: str | Path, family: str = "llama",
                 num_layers: int | None = None) -> DrafterCheckpoint:
    """Read and validate a drafter in any known layout. `family` (and for SGLang's GPT-OSS
    rule `num_layers`) maps a foreign checkpoint's layer ids to the canonical convention;
    checkpoints draftsmith wrote carry their canonical ids."""
    directory = Path(directory)
    layout_name = detect_layout(directory)
    fix = native.REMAKE if layout_name == "native" else REFETCH
    if layout_name == "native":
        raw = native.read_native_meta(directory)
        cfg = native.config_of(raw, directory / native.META_FILE)
        # Native tensor names: EAGLE-3's are SGLang's, DFlash's vLLM's.
        layout = kind_of(cfg).native_layout()
    else:
        layout = _layout_in(directory)
        raw = native.read_json_file(directory / "config.json", REFETCH)
        missing = layout.missing_config(raw)
        if missing:
            raise ExportError(f"{directory / 'config.json'}: missing config fields {missing} "
                              f"for the {layout.name} layout (SGLang fails without "
                              "draft_vocab_size and mis-loads without the others); add them, "
                              f"or {REFETCH}")
        if not set(layout.architectures()) & set(raw["architectures"]):
            raise ExportError(f"{directory / 'config.json'}: architectures is "
                              f"{raw['architectures']}, expected [{layout.architecture!r}]")
        try:
            cfg = layout.parse_config(raw, family, num_layers)
        except LayerIdError as err:
            raise ExportError(str(err)) from None
        except ExportError:
            raise
        except ValidationError as err:
            fields = ", ".join(".".join(str(p) for p in e["loc"]) + f" ({e['msg']})"
                               for e in err.errors())
            raise ExportError(f"{directory / 'config.json'}: values that make no drafter: "
                              f"{fields}; {REFETCH}") from None
        except (KeyError, TypeError, ValueError, IndexError) as err:
            raise ExportError(f"{directory / 'config.json'}: a field is missing or of the wrong "
                              f"type ({type(err).__name__}: {err}); {REFETCH}") from None
    files = read_weight_files(directory, fix)
    names = layout.read_names(files)  # older names the engine still loads, as today's
    files = {names[n]: t for n, t in files.items()}
    expected = layout.expected_tensors(cfg, optional=True)
    optional = {name: expected.pop(name) for name in OPTIONAL_TENSORS}  # no layer prefix
    problems = tensor_problems(files, expected, optional)
    tensors = {layout.to_native_name(n): t for n, t in files.items()}
    if "d2t" not in layout.expected_tensors(cfg):  # a full-vocab drafter: the identity map
        tensors.setdefault("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        tensors.setdefault("t2d", torch.ones(cfg.vocab_size, dtype=torch.bool))
    if problems:
        raise ExportError(f"{directory} is not a valid {layout_name} {kind_of(cfg).name} "
                          "drafter:\n  - " + "\n  - ".join(problems)
                          + f"\n{fix[0].upper()}{fix[1:]}")
    return DrafterCheckpoint(layout_name, cfg, tensors, raw)


def export_drafter(state: dict[str, torch.Tensor], cfg: DrafterShape, layout_name: str,
                   family: str, out_dir: str | Path, *, context_length: int | None = None,
                   extras: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write config.json + model.safetensors in `layout_name` (the drafter kind's layout of
    that name), validate what landed, return the written config. max_position_embeddings is
    raised to the target's context length, since SGLang refuses a draft shorter than its
    target."""
    layout = layout_named(layout_name, kind_of(cfg).name)
    out_dir = Path(out_dir)
    if context_length and context_length > cfg.max_position_embeddings:
        cfg = cfg.model_copy(update={"max_position_embeddings": context_length})
    try:
        config = layout.build_config(cfg, family, _dtype_name(state["fc.weight"]), extras or {})
    except LayerIdError as err:
        raise ExportError(str(err)) from None
    tensors = {layout.to_layout_name(name): state[name].detach().cpu().contiguous()
               for name in layout.native_tensors(cfg)}
    with atomic_path(out_dir / WEIGHTS_FILE, tensor_bytes(tensors)) as tmp:
        save_file(tensors, str(tmp), metadata={"format": "pt"})
    atomic_write_json(out_dir / "config.json", config)
    written = read_drafter(out_dir, family)
    if written.config.aux_layer_ids != cfg.aux_layer_ids:
        raise ExportError(f"{out_dir}: the written config reads back as aux layers "
                          f"{written.config.aux_layer_ids}, not {cfg.aux_layer_ids}")
    return config


def _dtype_name(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


@dataclass
class ImportReport:
    source: str
    layout: str
    out_dir: str
    config: DrafterShape
    tensors: int
    dropped: list[str]


def import_drafter(source: str | Path, out_dir: str | Path, family: str = "llama",
                   num_layers: int | None = None) -> ImportReport:
    """Convert a drafter from any layout to draftsmith native (validated on both ends)."""
    checkpoint = read_drafter(source, family, num_layers)
    drafter = build_drafter(checkpoint.config)
    state = {n: t for n, t in checkpoint.tensors.items() if n not in OPTIONAL_TENSORS}
    # The embedding is the target's: it stays NaN here and is copied in when loaded.
    missing, unexpected = drafter.load_state_dict(state, strict=False)
    if unexpected or set(missing) - set(OPTIONAL_TENSORS):
        raise ExportError(f"{source}: tensors do not fit the drafter: missing {missing}, "
                          f"unexpected {unexpected}")
    native.save_native(drafter, out_dir, {"imported_from": str(Path(source).resolve()),
                                          "source_layout": checkpoint.layout,
                                          "target_family": family})
    read_drafter(out_dir)  # what was written reads back and validates
    return ImportReport(str(source), checkpoint.layout, str(out_dir), checkpoint.config,
                        len(state), sorted(set(checkpoint.tensors) - set(state)))


def describe(directory: str | Path, family: str = "llama",
             num_layers: int | None = None) -> dict[str, Any]:
    """What `draftsmith inspect` prints: layout, shapes, vocab sizes, layer ids, verdict."""
    directory = Path(directory)
    info: dict[str, Any] = {"path": str(directory)}
    try:
        info["layout"] = detect_layout(directory)
        checkpoint = read_drafter(directory, family, num_layers)
    except ExportError as err:
        info["valid"] = False
        info["problems"] = str(err)
        return info
    cfg = checkpoint.config
    info.update(kind=checkpoint.kind, **kind_of(cfg).describe(cfg))
    info.update(
        valid=True,
        shapes={n: list(t.shape) for n, t in sorted(checkpoint.tensors.items())},
        dtype=_dtype_name(checkpoint.tensors["fc.weight"]),
        vocab_size=cfg.vocab_size, draft_vocab_size=cfg.draft_vocab_size,
        hidden_size=cfg.hidden_size, target_hidden_size=cfg.target_hidden_size,
        max_position_embeddings=cfg.max_position_embeddings,
        canonical_aux_layer_ids=cfg.aux_layer_ids,
    )
    for layout in kind_of(cfg).layouts().values():
        key = f"{layout.name}_aux_layer_ids"
        try:
            info[key] = engine_layer_ids(cfg.aux_layer_ids, family, layout.engine)
        except LayerIdError as err:
            info[key] = f"not expressible: {err}"
    return info
