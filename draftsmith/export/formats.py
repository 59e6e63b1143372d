"""Drafter checkpoint layouts, each described once (REFERENCE.md section 3).

The tensors a drafter has are derived from its config in one place (`drafter_tensors`, in
draftsmith's own names, which are SGLang's). A layout says how those names appear in its files
(`midlayer.*` or `layers.0.*`), which config fields it requires, and how its config.json maps to
and from `Eagle3Config`. The converter and the validator both use these descriptions, so the
two cannot drift apart.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from draftsmith.errors import InputError
from draftsmith.export.layer_ids import canonical_layer_ids, engine_layer_ids
from draftsmith.model.eagle3 import Eagle3Config

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
    if optional:
        specs["embed_tokens.weight"] = TensorSpec((cfg.vocab_size, H), "float")
    return specs


@dataclass(frozen=True)
class Layout:
    """One on-disk drafter layout: names, architecture, required config fields."""

    name: str
    engine: str  # whose layer-id rule applies: "sglang" or "vllm"
    architecture: str
    layer_prefix: str
    required_config: tuple[str, ...]
    # vLLM creates no draft_id_to_target_id when draft_vocab_size == vocab_size, and a d2t
    # tensor then fails to load: such a layout leaves the (identity) vocab map out.
    identity_vocab_map_omitted: bool = False
    # Other names the same layout is saved under (read, never written).
    also_read_as: tuple[str, ...] = ()

    def architectures(self) -> tuple[str, ...]:
        return (self.architecture, *self.also_read_as)

    def native_tensors(self, cfg: Eagle3Config, optional: bool = False) -> dict[str, TensorSpec]:
        """drafter_tensors(cfg), less what this layout leaves out."""
        specs = drafter_tensors(cfg, optional)
        if self.identity_vocab_map_omitted and cfg.draft_vocab_size == cfg.vocab_size:
            specs = {n: spec for n, spec in specs.items() if n not in VOCAB_MAP}
        return specs

    def to_layout_name(self, native: str) -> str:
        if native.startswith(NATIVE_LAYER_PREFIX):
            return self.layer_prefix + native.removeprefix(NATIVE_LAYER_PREFIX)
        return native

    def to_native_name(self, name: str) -> str:
        if name.startswith(self.layer_prefix):
            return NATIVE_LAYER_PREFIX + name.removeprefix(self.layer_prefix)
        return name

    def expected_tensors(self, cfg: Eagle3Config, optional: bool = False) -> dict[str, TensorSpec]:
        return {self.to_layout_name(n): s for n, s in self.native_tensors(cfg, optional).items()}

    def is_layout_of(self, config: dict[str, Any]) -> bool:
        return any(a in (config.get("architectures") or []) for a in self.architectures())

    def build_config(self, cfg: Eagle3Config, family: str, dtype: str,
                     extras: dict[str, Any]) -> dict[str, Any]:
        raise NotImplementedError

    def parse_config(self, config: dict[str, Any], family: str,
                     num_layers: int | None = None) -> Eagle3Config:
        raise NotImplementedError

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
    """SGLang / EAGLE / SpecForge: LlamaForCausalLMEagle3 with `midlayer.*` weights."""

    def build_config(self, cfg, family, dtype, extras):
        return {
            "architectures": [self.architecture],
            **cfg.hf_fields(),
            "draft_vocab_size": cfg.draft_vocab_size,
            "target_hidden_size": cfg.target_hidden_size,
            # fc's input width in aux states; SGLang 0.5.23 reads it before counting the ids
            # (0.5.9 assumed 3).
            "num_aux_hidden_states": len(cfg.aux_layer_ids),
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
        return Eagle3Config.from_hf(
            config, draft_vocab_size=config["draft_vocab_size"],
            target_hidden_size=config.get("target_hidden_size") or config["hidden_size"],
            aux_layer_ids=self.canonical_ids(config, family, num_layers))


class SpeculatorsLayout(Layout):
    """speculators / vLLM: Eagle3Speculator with `layers.0.*` weights and a nested Llama
    config. norm_before_residual is written false: vLLM assumes true when it is missing."""

    def build_config(self, cfg, family, dtype, extras):
        verifier = extras.get("verifier") or {}
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
            "transformer_layer_config": {**cfg.hf_fields(),
                                         "num_aux_hidden_states": len(cfg.aux_layer_ids)},
            "draft_vocab_size": cfg.draft_vocab_size,
            "target_hidden_size": cfg.target_hidden_size,
            "norm_before_residual": False,
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
        if config.get("norm_before_residual", True):
            raise ExportError(
                "this speculators drafter uses norm_before_residual=true (or leaves it unset, "
                "which vLLM reads as true); draftsmith's drafter is the plain EAGLE-3 variant "
                "(false) and cannot run it"
            )
        layer = config["transformer_layer_config"]
        return Eagle3Config.from_hf(
            layer, draft_vocab_size=config["draft_vocab_size"],
            target_hidden_size=config.get("target_hidden_size") or layer["hidden_size"],
            aux_layer_ids=self.canonical_ids(config, family, num_layers))


SGLANG = SGLangLayout(
    name="sglang", engine="sglang", architecture="LlamaForCausalLMEagle3",
    layer_prefix="midlayer.",
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
                     "norm_before_residual", "eagle_aux_hidden_state_layer_ids"),
    identity_vocab_map_omitted=True,
    # speculators' own trainer (0.9.0) saves its Eagle3DraftModel under that name; vLLM
    # reads speculators_model_type, and the tensors and config are the same layout.
    also_read_as=("Eagle3DraftModel",),
)
LAYOUTS: dict[str, Layout] = {layout.name: layout for layout in (SGLANG, SPECULATORS)}


def layout_named(name: str) -> Layout:
    if name not in LAYOUTS:
        raise ExportError(f"unknown layout {name!r}; choose from {sorted(LAYOUTS)}")
    return LAYOUTS[name]
