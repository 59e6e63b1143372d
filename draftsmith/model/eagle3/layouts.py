"""EAGLE-3's tensors and its two checkpoint layouts: SGLang's (`midlayer.*`, draftsmith's own
names) and speculators' for vLLM (`layers.0.*`, a nested Llama config)."""

from __future__ import annotations

import logging

from draftsmith.export.layer_ids import engine_layer_ids
from draftsmith.export.layout import ExportError, Layout, TensorSpec
from draftsmith.model.eagle3.model import NORM_OPTIONS, Eagle3Config

log = logging.getLogger(__name__)


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


class Eagle3Layout(Layout):
    """A layout of EAGLE-3 drafters."""

    def tensors(self, cfg: Eagle3Config, optional: bool = False) -> dict[str, TensorSpec]:
        return drafter_tensors(cfg, optional)


class SGLangLayout(Eagle3Layout):
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


class SpeculatorsLayout(Eagle3Layout):
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
    name="sglang", engine="sglang", architecture="LlamaForCausalLMEagle3", kind="eagle3",
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
    name="speculators", engine="vllm", architecture="Eagle3Speculator", kind="eagle3",
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
