"""Drafter checkpoint layouts, each described once (REFERENCE.md section 3), per drafter kind.

The tensors a drafter has are derived from its config in one place (`drafter_tensors` for
EAGLE-3, in draftsmith's own names, which are SGLang's; `dflash_tensors` for DFlash, in vLLM's).
A layout says how those names appear in its files (`midlayer.*` or `layers.0.*`), which config
fields it requires, and how its config.json maps to and from the kind's config. The converter
and the validator both use these descriptions, so the two cannot drift apart.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from draftsmith.errors import InputError
from draftsmith.export.layer_ids import canonical_layer_ids, engine_layer_ids
from draftsmith.model.dflash import DFlashConfig
from draftsmith.model.eagle3 import NORM_OPTIONS, Eagle3Config

log = logging.getLogger(__name__)

NATIVE_LAYER_PREFIX = "midlayer."
# Present in some checkpoints (SpecForge, speculators); never required, never exported: the
# serving engine shares the target's embedding.
OPTIONAL_TENSORS = ("embed_tokens.weight",)
VOCAB_MAP = ("d2t", "t2d")


class ExportError(InputError, ValueError):
    pass


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: str  # "float" (the checkpoint's weight dtype), "int64" or "bool"


def drafter_tensors(cfg: Eagle3Config, optional: bool = False) -> dict[str, TensorSpec]:
    """Every tensor of an EAGLE-3 drafter with `cfg`, in draftsmith's (= SGLang's) names."""
    H, I, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim  # noqa: E741
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    k = len(cfg.aux_layer_ids)
    specs = {
        "fc.weight": TensorSpec((H, k * cfg.target_hidden_size), "float"),
        "midlayer.input_layernorm.weight": TensorSpec((H,), "float"),
        "midlayer.hidden_norm.weight": TensorSpec((H,), "float"),
        "midlayer.post_attention_layernorm.weight": TensorSpec((H,), "float"),
        "midlayer.self_attn.q_proj.weight": TensorSpec((q, 2 * H), "float"),
        "midlayer.self_attn.k_proj.weight": TensorSpec((kv, 2 * H), "float"),
        "midlayer.self_attn.v_proj.weight": TensorSpec((kv, 2 * H), "float"),
        "midlayer.self_attn.o_proj.weight": TensorSpec((H, q), "float"),
        "midlayer.mlp.gate_proj.weight": TensorSpec((I, H), "float"),
        "midlayer.mlp.up_proj.weight": TensorSpec((I, H), "float"),
        "midlayer.mlp.down_proj.weight": TensorSpec((H, I), "float"),
        "norm.weight": TensorSpec((H,), "float"),
        "lm_head.weight": TensorSpec((cfg.draft_vocab_size, H), "float"),
        "d2t": TensorSpec((cfg.draft_vocab_size,), "int64"),
        "t2d": TensorSpec((cfg.vocab_size,), "bool"),
    }
    if cfg.norm_before_fc:  # EAGLE-3.1: one RMSNorm over the concatenated aux states
        specs["input_norm.weight"] = TensorSpec((k * cfg.target_hidden_size,), "float")
    if cfg.fc_norm:  # EAGLE-3.1: one RMSNorm per aux state
        specs.update({f"fc_norm.{i}.weight": TensorSpec((cfg.target_hidden_size,), "float")
                      for i in range(k)})
    if optional:
        specs["embed_tokens.weight"] = TensorSpec((cfg.vocab_size, H), "float")
    return specs


def dflash_tensors(cfg: DFlashConfig, optional: bool = False) -> dict[str, TensorSpec]:
    """Every tensor of a DFlash drafter with `cfg`, in draftsmith's (= vLLM's) names: Qwen3
    layers (q_norm and k_norm per head), fc and hidden_norm for the context, the final norm,
    its own lm_head over the draft vocab, and the vocab map."""
    H, I, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim  # noqa: E741
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    specs = {"fc.weight": TensorSpec((H, len(cfg.aux_layer_ids) * cfg.target_hidden_size),
                                     "float"),
             "hidden_norm.weight": TensorSpec((H,), "float")}
    for i in range(cfg.num_hidden_layers):
        layer = f"layers.{i}."
        specs.update({
            layer + "input_layernorm.weight": TensorSpec((H,), "float"),
            layer + "post_attention_layernorm.weight": TensorSpec((H,), "float"),
            layer + "self_attn.q_proj.weight": TensorSpec((q, H), "float"),
            layer + "self_attn.k_proj.weight": TensorSpec((kv, H), "float"),
            layer + "self_attn.v_proj.weight": TensorSpec((kv, H), "float"),
            layer + "self_attn.o_proj.weight": TensorSpec((H, q), "float"),
            layer + "self_attn.q_norm.weight": TensorSpec((d,), "float"),
            layer + "self_attn.k_norm.weight": TensorSpec((d,), "float"),
            layer + "mlp.gate_proj.weight": TensorSpec((I, H), "float"),
            layer + "mlp.up_proj.weight": TensorSpec((I, H), "float"),
            layer + "mlp.down_proj.weight": TensorSpec((H, I), "float"),
        })
    specs.update({"norm.weight": TensorSpec((H,), "float"),
                  "lm_head.weight": TensorSpec((cfg.draft_vocab_size, H), "float"),
                  "d2t": TensorSpec((cfg.draft_vocab_size,), "int64"),
                  "t2d": TensorSpec((cfg.vocab_size,), "bool")})
    if optional:
        specs["embed_tokens.weight"] = TensorSpec((cfg.vocab_size, H), "float")
    return specs


def tensors_of(cfg: Eagle3Config | DFlashConfig, optional: bool = False
               ) -> dict[str, TensorSpec]:
    """The tensors of a drafter of any kind, in draftsmith's names."""
    if isinstance(cfg, DFlashConfig):
        return dflash_tensors(cfg, optional)
    return drafter_tensors(cfg, optional)


@dataclass(frozen=True)
class Layout:
    """One on-disk drafter layout: names, architecture, required config fields."""

    name: str
    engine: str  # whose layer-id rule applies: "sglang" or "vllm"
    architecture: str
    layer_prefix: str
    required_config: tuple[str, ...]
    kind: str = "eagle3"  # the drafter kind it holds (draftsmith/model/kinds.py)
    native_prefix: str = NATIVE_LAYER_PREFIX  # the layer names' prefix in draftsmith's names
    # vLLM creates no draft_id_to_target_id when draft_vocab_size == vocab_size, and a d2t
    # tensor then fails to load: such a layout leaves the (identity) vocab map out.
    identity_vocab_map_omitted: bool = False
    # Other names the same layout is saved under (read, never written).
    also_read_as: tuple[str, ...] = ()
    # Older tensor names the engine still loads (read as the new ones, never written).
    legacy_names: tuple[tuple[str, str], ...] = ()

    def architectures(self) -> tuple[str, ...]:
        return (self.architecture, *self.also_read_as)

    def native_tensors(self, cfg, optional: bool = False) -> dict[str, TensorSpec]:
        """tensors_of(cfg), less what this layout leaves out."""
        specs = tensors_of(cfg, optional)
        if self.identity_vocab_map_omitted and cfg.draft_vocab_size == cfg.vocab_size:
            specs = {n: spec for n, spec in specs.items() if n not in VOCAB_MAP}
        return specs

    def to_layout_name(self, native: str) -> str:
        if native.startswith(self.native_prefix):
            return self.layer_prefix + native.removeprefix(self.native_prefix)
        return native

    def to_native_name(self, name: str) -> str:
        if name.startswith(self.layer_prefix):
            return self.native_prefix + name.removeprefix(self.layer_prefix)
        return name

    def read_names(self, names: Iterable[str]) -> dict[str, str]:
        """Each file name as this layout's current name (older names the engine still loads
        renamed; anything else as it is, for the validator to judge)."""
        renamed = {}
        for name in names:
            renamed[name] = name
            for legacy, current in self.legacy_names:
                if name.startswith(legacy):
                    renamed[name] = current + name.removeprefix(legacy)
        return renamed

    def expected_tensors(self, cfg, optional: bool = False) -> dict[str, TensorSpec]:
        return {self.to_layout_name(n): s for n, s in self.native_tensors(cfg, optional).items()}

    def is_layout_of(self, config: dict[str, Any]) -> bool:
        return any(a in (config.get("architectures") or []) for a in self.architectures())

    def build_config(self, cfg, family: str, dtype: str,
                     extras: dict[str, Any]) -> dict[str, Any]:
        raise NotImplementedError

    def parse_config(self, config: dict[str, Any], family: str,
                     num_layers: int | None = None):
        raise NotImplementedError

    def check(self, cfg) -> None:
        """What this layout cannot hold raises ExportError before anything is written."""

    def written_layer_ids(self, config: dict[str, Any]) -> list[int]:
        raise NotImplementedError

    def canonical_ids(self, config: dict[str, Any], family: str,
                      num_layers: int | None) -> list[int]:
        """draftsmith's own exports say their canonical ids; others follow the engine rule."""
        ours = config.get("draftsmith") or {}
        written = self.written_layer_ids(config)
        canonical = ours.get("canonical_aux_layer_ids")
        if not canonical:
            return canonical_layer_ids(written, family, self.engine, num_layers)
        # The engine reads the written ids, not ours: an edited file must not pass unnoticed.
        expected = engine_layer_ids(canonical, ours.get("target_family") or family, self.engine)
        if written != expected:
            raise ExportError(
                f"the aux layer ids the engine reads ({written}) disagree with "
                f"draftsmith.canonical_aux_layer_ids {canonical}, which a "
                f"{ours.get('target_family') or family} target needs written as {expected}; "
                "the config was edited or damaged: export it again with `draftsmith export`")
        return canonical

    def missing_config(self, config: dict[str, Any]) -> list[str]:
        return [f for f in self.required_config if _lookup(config, f) is None]


def _lookup(config: dict[str, Any], dotted: str) -> Any:
    node: Any = config
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


class SGLangLayout(Layout):
    """SGLang / EAGLE / SpecForge: LlamaForCausalLMEagle3 with `midlayer.*` weights.

    EAGLE-3.1 in SGLang 0.5.23 (models/llama_eagle3.py): norm_before_fc (from eagle_config,
    else the top level) loads `input_norm.weight`, fc_norm (or the older use_aux_norm) loads
    `fc_norm.{i}.weight` (older names aux_norm_low/mid/high), norm_output feeds the normed
    output forward. norm_before_residual is not read: its first layer always keeps the residual
    before hidden_norm, and the draft's sliding window comes from a server flag, not the
    config. Export refuses both rather than write a drafter SGLang would run another way."""

    def build_config(self, cfg, family, dtype, extras):
        if cfg.norm_before_residual:
            raise ExportError(
                "this drafter was trained with norm_before_residual=true (EAGLE-3.1), which "
                "SGLang 0.5.23 cannot run: its LlamaForCausalLMEagle3 always takes the residual "
                "before hidden_norm, and would run the drafter differently without a warning. "
                "Export it with export.format=speculators for vLLM, or train with "
                "drafter.norm_before_residual=false for SGLang")
        if cfg.sliding_window is not None:
            raise ExportError(
                f"this drafter attends through a sliding window of {cfg.sliding_window} "
                "positions; SGLang 0.5.23 takes the draft's window from the server flag "
                "--speculative-draft-window-size, not from config.json. Export it with "
                "export.format=speculators for vLLM (which reads the window from the config)")
        return {
            "architectures": [self.architecture],
            **cfg.hf_fields(),
            "draft_vocab_size": cfg.draft_vocab_size,
            "target_hidden_size": cfg.target_hidden_size,
            # fc's input width in aux states; SGLang 0.5.23 reads it before counting the ids
            # (0.5.9 assumed 3).
            "num_aux_hidden_states": len(cfg.aux_layer_ids),
            # EAGLE-3.1's flags, where SGLang reads them (norm_before_residual is false here).
            **cfg.norm_flags,
            "torch_dtype": dtype,
            "eagle_config": {
                "eagle_aux_hidden_state_layer_ids": engine_layer_ids(cfg.aux_layer_ids, family,
                                                                     self.engine),
                "use_aux_hidden_state": True,
            },
            # Not read by SGLang: lets draftsmith map the ids back without knowing the family.
            "draftsmith": {"canonical_aux_layer_ids": cfg.aux_layer_ids, "target_family": family,
                           **extras},
        }

    def written_layer_ids(self, config):
        return list(config["eagle_config"]["eagle_aux_hidden_state_layer_ids"])

    def parse_config(self, config, family, num_layers=None):
        eagle = config.get("eagle_config") or {}
        norms = {
            # What SGLang runs; norm_before_residual it never reads, so a file that says true
            # was trained that way (SpecForge) and is read as trained: export then refuses
            # to write it back for SGLang.
            "norm_before_residual": bool(config.get("norm_before_residual", False)),
            "norm_before_fc": bool(eagle.get("norm_before_fc",
                                             config.get("norm_before_fc", False))),
            "fc_norm": bool(config.get("fc_norm") or config.get("use_aux_norm", False)),
            "norm_output": bool(config.get("norm_output", False)),
        }
        return Eagle3Config.from_hf(
            config, draft_vocab_size=config["draft_vocab_size"],
            target_hidden_size=config.get("target_hidden_size") or config["hidden_size"],
            aux_layer_ids=self.canonical_ids(config, family, num_layers), **norms)


class SpeculatorsLayout(Layout):
    """speculators / vLLM: Eagle3Speculator with `layers.0.*` weights and a nested Llama
    config. EAGLE-3.1's four flags are always written: vLLM 0.32 reads a missing
    norm_before_residual as true, the others as false. A sliding window goes where vLLM reads
    it: transformer_layer_config's sliding_window and layer_types."""

    def build_config(self, cfg, family, dtype, extras):
        verifier = extras.get("verifier") or {}
        layer = {**cfg.hf_fields(), "num_aux_hidden_states": len(cfg.aux_layer_ids)}
        if cfg.sliding_window is not None:
            layer.update(sliding_window=cfg.sliding_window, use_sliding_window=True,
                         layer_types=["sliding_attention"])
        return {
            "architectures": [self.architecture],
            "speculators_model_type": "eagle3",
            "speculators_config": {
                "algorithm": "eagle3",
                "proposal_methods": [{
                    "proposal_type": "greedy",
                    "speculative_tokens": extras.get("speculative_tokens", 3),
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }],
                "default_proposal_method": "greedy",
                "verifier": {"name_or_path": verifier.get("name_or_path", ""),
                             "architectures": verifier.get("architectures", [])},
            },
            # vLLM builds the drafter from this dict; its fc is 3*H unless it holds
            # num_aux_hidden_states (the ids at top level are not where vLLM counts them).
            "transformer_layer_config": layer,
            "draft_vocab_size": cfg.draft_vocab_size,
            "target_hidden_size": cfg.target_hidden_size,
            **cfg.norm_flags,
            "eagle_aux_hidden_state_layer_ids": engine_layer_ids(cfg.aux_layer_ids, family,
                                                                 self.engine),
            "tie_word_embeddings": False,
            "torch_dtype": dtype,
            "draftsmith": {"canonical_aux_layer_ids": cfg.aux_layer_ids, "target_family": family,
                           **({"target_provenance": extras["target_provenance"]}
                              if extras.get("target_provenance") else {})},
        }

    def is_layout_of(self, config):
        return (config.get("speculators_model_type") == "eagle3"
                or super().is_layout_of(config))

    def written_layer_ids(self, config):
        return list(config["eagle_aux_hidden_state_layer_ids"])

    def parse_config(self, config, family, num_layers=None):
        layer = config["transformer_layer_config"]
        if layer.get("model_type", "llama") != "llama":
            raise ExportError(
                f"transformer_layer_config.model_type is {layer['model_type']!r}: draftsmith's "
                "EAGLE-3 drafter is Llama-shaped (speculators' draft_arch=llama, its EAGLE-3 "
                "default); a Qwen3-shaped one has q/k norms draftsmith does not run. Train it "
                "with --draft-arch llama, or serve it with vLLM directly")
        if layer.get("num_hidden_layers", 1) != 1:
            raise ExportError(
                f"transformer_layer_config.num_hidden_layers is {layer['num_hidden_layers']}: "
                "draftsmith's EAGLE-3 drafter has one decoder layer (speculators' --num-layers "
                "1, its EAGLE-3 default)")
        if "norm_before_residual" not in config:
            log.warning("config.json has no norm_before_residual: read as true, as vLLM 0.32 "
                        "reads it (speculators writes the key; a file without it may not "
                        "have been trained that way)")
        # vLLM's reading (update_eagle3): an absent norm_before_residual is true.
        norms = {name: bool(config.get(name, name == "norm_before_residual"))
                 for name in NORM_OPTIONS}
        layer_types = layer.get("layer_types") or []
        window = layer.get("sliding_window") if "sliding_attention" in layer_types[:1] \
            else None
        return Eagle3Config.from_hf(
            layer, draft_vocab_size=config["draft_vocab_size"],
            target_hidden_size=config.get("target_hidden_size") or layer["hidden_size"],
            aux_layer_ids=self.canonical_ids(config, family, num_layers),
            sliding_window=window, **norms)


SGLANG = SGLangLayout(
    name="sglang", engine="sglang", architecture="LlamaForCausalLMEagle3",
    layer_prefix="midlayer.",
    legacy_names=(("aux_norm_low.", "fc_norm.0."), ("aux_norm_mid.", "fc_norm.1."),
                  ("aux_norm_high.", "fc_norm.2.")),
    required_config=("architectures", "model_type", "num_hidden_layers", "hidden_size",
                     "intermediate_size", "num_attention_heads", "num_key_value_heads",
                     "vocab_size", "draft_vocab_size", "target_hidden_size",
                     "max_position_embeddings", "tie_word_embeddings",
                     "eagle_config.eagle_aux_hidden_state_layer_ids",
                     "eagle_config.use_aux_hidden_state"),
)
SPECULATORS = SpeculatorsLayout(
    name="speculators", engine="vllm", architecture="Eagle3Speculator",
    layer_prefix="layers.0.",
    required_config=("architectures", "speculators_model_type",
                     "speculators_config.algorithm", "speculators_config.proposal_methods",
                     "speculators_config.verifier", "transformer_layer_config.hidden_size",
                     "transformer_layer_config.vocab_size",
                     "transformer_layer_config.max_position_embeddings", "draft_vocab_size",
                     "eagle_aux_hidden_state_layer_ids"),
    identity_vocab_map_omitted=True,
    # speculators' own trainer (0.9.0) saves its Eagle3DraftModel under that name; vLLM
    # reads speculators_model_type, and the tensors and config are the same layout.
    also_read_as=("Eagle3DraftModel",),
)


def _speculators_verifier(extras: dict[str, Any]) -> dict[str, Any]:
    verifier = extras.get("verifier") or {}
    return {"name_or_path": verifier.get("name_or_path", ""),
            "architectures": verifier.get("architectures", [])}


class DFlashSpeculatorsLayout(Layout):
    """DFlash for vLLM 0.32: the speculators layout (`speculators_model_type: dflash`). vLLM's
    update_dflash reads aux_hidden_state_layer_ids (inputs of layers: written canonical + 1,
    and it sets dflash_config.target_layer_ids = those - 1), mask_token_id (required),
    sliding_window_non_causal (causal = its negation, default non-causal) and
    sample_from_anchor (false: the anchor is the known token, block_size - 1 drafts); the
    Qwen3-shaped layers come from transformer_layer_config (DFlashQwen3ForCausalLM)."""

    def build_config(self, cfg: DFlashConfig, family, dtype, extras):
        layer = {
            "model_type": "qwen3", "num_hidden_layers": cfg.num_hidden_layers,
            "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
            "num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
            "hidden_act": cfg.hidden_act, "rms_norm_eps": cfg.rms_norm_eps,
            "rope_theta": cfg.rope_theta,
            # transformers 5 keeps RoPE here; both are written so either reader finds it.
            "rope_parameters": {"rope_theta": cfg.rope_theta, "rope_type": "default",
                                **(cfg.rope_scaling or {})},
            "max_position_embeddings": cfg.max_position_embeddings,
            "vocab_size": cfg.vocab_size, "tie_word_embeddings": False,
            "attention_bias": False,
        }
        if cfg.rope_scaling:
            layer["rope_scaling"] = cfg.rope_scaling
        return {
            "architectures": [self.architecture],
            "speculators_model_type": "dflash",
            "speculators_config": {
                "algorithm": "dflash",
                "proposal_methods": [{"proposal_type": "greedy",
                                      "speculative_tokens": cfg.block_size - 1,
                                      "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                "default_proposal_method": "greedy",
                "verifier": _speculators_verifier(extras),
            },
            "transformer_layer_config": layer,
            "draft_vocab_size": cfg.draft_vocab_size,
            "target_hidden_size": cfg.target_hidden_size,
            "aux_hidden_state_layer_ids": engine_layer_ids(cfg.aux_layer_ids, family,
                                                           self.engine),
            "block_size": cfg.block_size,
            "mask_token_id": cfg.mask_token_id,
            "sliding_window_non_causal": not cfg.causal,
            "sample_from_anchor": False,
            "torch_dtype": dtype,
            "draftsmith": {"canonical_aux_layer_ids": cfg.aux_layer_ids, "target_family": family,
                           **({"target_provenance": extras["target_provenance"]}
                              if extras.get("target_provenance") else {})},
        }

    def is_layout_of(self, config):
        return config.get("speculators_model_type") == "dflash"

    def written_layer_ids(self, config):
        return list(config["aux_hidden_state_layer_ids"])

    def parse_config(self, config, family, num_layers=None):
        layer = config["transformer_layer_config"]
        if config.get("sample_from_anchor", False):
            raise ExportError("sample_from_anchor=true (the anchor position drafts too, as "
                              "DSpark does): draftsmith's DFlash drafts from the mask positions "
                              "only, as vLLM's DFlash runs it by default")
        for flag in ("use_swa", "attention_sink_bias", "attention_value_scale"):
            if (config.get("dflash_config") or {}).get(flag) or layer.get(flag):
                raise ExportError(f"{flag} is set: a DFlash variant draftsmith does not run")
        if "sliding_attention" in (layer.get("layer_types") or []):
            raise ExportError("transformer_layer_config.layer_types has sliding_attention: a "
                              "sliding-window DFlash drafter, which draftsmith does not run")
        heads = layer["num_attention_heads"]
        rope = layer.get("rope_parameters") or {}
        return DFlashConfig(
            hidden_size=layer["hidden_size"], intermediate_size=layer["intermediate_size"],
            num_attention_heads=heads,
            num_key_value_heads=layer.get("num_key_value_heads") or heads,
            head_dim=layer.get("head_dim") or layer["hidden_size"] // heads,
            rms_norm_eps=layer.get("rms_norm_eps", 1e-6),
            rope_theta=layer.get("rope_theta", rope.get("rope_theta", 10000.0)),
            rope_scaling=layer.get("rope_scaling"),
            max_position_embeddings=layer.get("max_position_embeddings", 4096),
            vocab_size=layer["vocab_size"], draft_vocab_size=config["draft_vocab_size"],
            target_hidden_size=config.get("target_hidden_size") or layer["hidden_size"],
            aux_layer_ids=self.canonical_ids(config, family, num_layers),
            hidden_act=layer.get("hidden_act", "silu"),
            num_hidden_layers=layer["num_hidden_layers"],
            block_size=config.get("block_size")
            or config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] + 1,
            mask_token_id=config["mask_token_id"],
            # vLLM's reading: causal = not sliding_window_non_causal, absent meaning true.
            causal=not config.get("sliding_window_non_causal", True))


DFLASH_SPECULATORS = DFlashSpeculatorsLayout(
    name="speculators", engine="vllm", architecture="DFlashSpeculator", kind="dflash",
    layer_prefix="layers.", native_prefix="layers.",
    required_config=("architectures", "speculators_model_type", "speculators_config.algorithm",
                     "speculators_config.proposal_methods", "speculators_config.verifier",
                     "transformer_layer_config.hidden_size",
                     "transformer_layer_config.num_hidden_layers",
                     "transformer_layer_config.vocab_size", "draft_vocab_size",
                     "aux_hidden_state_layer_ids", "mask_token_id"),
    identity_vocab_map_omitted=True,
    # speculators 0.9.0's trainer saves its DFlashDraftModel under its class name.
    also_read_as=("DFlashDraftModel",),
)

# Every layout, by drafter kind and then by name (export.format).
LAYOUTS_BY_KIND: dict[str, dict[str, Layout]] = {
    "eagle3": {layout.name: layout for layout in (SGLANG, SPECULATORS)},
    "dflash": {layout.name: layout for layout in (DFLASH_SPECULATORS,)},
}
LAYOUTS: dict[str, Layout] = LAYOUTS_BY_KIND["eagle3"]  # EAGLE-3's, the default kind's


def layout_named(name: str, kind: str = "eagle3") -> Layout:
    layouts = LAYOUTS_BY_KIND.get(kind, {})
    if name not in layouts:
        raise ExportError(f"no {name!r} layout for a {kind} drafter; choose from "
                          f"{sorted(layouts)}")
    return layouts[name]


def all_layouts() -> list[Layout]:
    return [layout for layouts in LAYOUTS_BY_KIND.values() for layout in layouts.values()]
