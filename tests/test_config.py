"""draftsmith.config: YAML in, validated; errors name the dotted key and the fix."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from draftsmith.config import (
    ConfigError,
    DeployConfig,
    PipelineConfig,
    apply_overrides,
    load_config,
    parse_config,
)

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"


def write_config(directory: Path, raw: dict, name: str = "config.yaml") -> Path:
    path = directory / name
    path.write_text(yaml.safe_dump(raw))
    return path


def minimal_raw(**sections) -> dict:
    raw = {"data": {"sources": [{"name": "demo", "path": "data.jsonl"}]}}
    raw.update(sections)
    return raw


# --- the shipped examples ---------------------------------------------------------------------


def test_tiny_example_validates_and_resolves_data_paths():
    config = load_config(EXAMPLES / "tiny.yaml")
    assert isinstance(config, PipelineConfig)
    assert config.target.model == "builtin:tiny"
    assert [s.name for s in config.data.sources] == ["stdlib-sharegpt", "stdlib-openai"]
    for source in config.data.sources:
        assert Path(source.path).is_absolute()
        assert Path(source.path).is_file(), source.path
    assert config.merge.draft_vocab_size == 1024
    assert config.extract.aux_layer_ids is None
    assert Path(config.run_root).is_absolute()


def test_kimi_example_validates():
    config = load_config(EXAMPLES / "kimi-k2.5-8gpu.yaml")
    assert config.target.family == "deepseek"
    assert config.target.tp_size == 8
    assert config.extract.aux_layer_ids == [2, 30, 58]
    assert config.deploy.engine == "sglang"
    assert config.deploy.speculative_algorithm == "EAGLE3"
    assert config.deploy.cuda_graph_max_bs_decode == 8 and config.deploy.extra_args == []
    # Absolute paths are kept as written.
    assert config.data.sources[0].path == "/mnt/shared/datasets/sharegpt.jsonl"
    assert config.run_root == "/mnt/shared/draftsmith/kimi-k2.5"


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")


def test_top_level_must_be_a_mapping(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(path)


# --- unknown keys and bad values ---------------------------------------------------------------


def test_unknown_top_level_key_is_named(tmp_path):
    path = write_config(tmp_path, minimal_raw(trian={"epochs": 2}))
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert "trian: unknown key" in str(err.value)
    assert str(path) in str(err.value)


def test_unknown_nested_key_is_named_with_dots(tmp_path):
    path = write_config(tmp_path, minimal_raw(train={"epoch": 2}))
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert "train.epoch: unknown key" in str(err.value)


def test_target_backend_is_refused_with_the_per_stage_settings(tmp_path):
    """target.backend was accepted and read nowhere: a config that sets it learns where the
    backend is chosen instead of believing it took effect."""
    path = write_config(tmp_path, minimal_raw(target={"model": "builtin:tiny",
                                                      "backend": "sglang"}))
    with pytest.raises(ConfigError, match=r"target.backend='sglang' is not a setting.*"
                                          r"extract.backend and deploy.engine"):
        load_config(path)


def test_unknown_key_in_a_source_names_its_index(tmp_path):
    raw = minimal_raw()
    raw["data"]["sources"][0]["limt"] = 3
    with pytest.raises(ConfigError, match=r"data\.sources\.0\.limt: unknown key"):
        load_config(write_config(tmp_path, raw))


@pytest.mark.parametrize(
    ("section", "values", "dotted"),
    [
        ("train", {"lr": -1}, "train.lr"),
        ("train", {"epochs": "many"}, "train.epochs"),
        ("train", {"epochs": 0}, "train.epochs"),
        ("merge", {"validation_fraction": 1.5}, "merge.validation_fraction"),
        ("deploy", {"port": 70000}, "deploy.port"),
        ("target", {"dtype": "float8"}, "target.dtype"),
    ],
)
def test_bad_value_names_the_key(tmp_path, section, values, dotted):
    with pytest.raises(ConfigError) as err:
        load_config(write_config(tmp_path, minimal_raw(**{section: values})))
    message = str(err.value)
    assert f"  {dotted}: " in message
    (value,) = values.values()
    assert repr(value) in message  # the offending input is shown


def test_data_section_is_required(tmp_path):
    with pytest.raises(ConfigError, match="data"):
        load_config(write_config(tmp_path, {"run_root": "x"}))


def test_duplicate_source_names_refused(tmp_path):
    raw = {"data": {"sources": [{"name": "a", "path": "1.jsonl"}, {"name": "a", "path": "2.jsonl"},
                                {"name": "b", "path": "3.jsonl"}]}}
    with pytest.raises(ConfigError) as err:
        load_config(write_config(tmp_path, raw))
    assert "duplicate source names ['a']" in str(err.value)


def test_parse_config_names_its_source():
    with pytest.raises(ConfigError, match=r"^my-source: invalid configuration"):
        parse_config(minimal_raw(train={"epoch": 1}), "my-source")


# --- overrides -------------------------------------------------------------------------------


def test_apply_overrides_parses_yaml_values():
    raw = minimal_raw(train={"epochs": 5})
    out = apply_overrides(raw, ["train.epochs=2", "extract.aux_layer_ids=[1, 2, 3]",
                                "merge.dedup=false", "train.lr=1.0e-4", "run_root=/tmp/x",
                                "deploy.extra_args=['--flag=1']"])
    assert out["train"]["epochs"] == 2
    assert out["extract"]["aux_layer_ids"] == [1, 2, 3]
    assert out["merge"]["dedup"] is False
    assert out["train"]["lr"] == pytest.approx(1e-4)
    assert out["run_root"] == "/tmp/x"
    assert out["deploy"]["extra_args"] == ["--flag=1"]  # only the first '=' splits


def test_apply_overrides_creates_missing_and_empty_sections():
    raw = {"train": None}
    apply_overrides(raw, ["train.epochs=3", "benchmark.num_prompts=4"])
    assert raw == {"train": {"epochs": 3}, "benchmark": {"num_prompts": 4}}


@pytest.mark.parametrize("bad", ["train.epochs", "=3", ""])
def test_malformed_override_is_an_error(bad):
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        apply_overrides(minimal_raw(), [bad])


def test_override_through_a_value_is_an_error():
    with pytest.raises(ConfigError, match="'run_root' is a value, not a section"):
        apply_overrides({"run_root": "x"}, ["run_root.sub=1"])


def test_an_entry_of_a_named_list_is_reached_by_its_name():
    """A data curve over one source: `draftsmith compare --variant 'half:
    data.sources.chat.limit=500'` instead of the whole list written out again."""
    raw = minimal_raw(data={"sources": [{"name": "code", "builtin": "python-functions"},
                                        {"name": "chat", "path": "chat.jsonl"}]})
    apply_overrides(raw, ["data.sources.chat.limit=500", "data.sources.code.builtin=humaneval"])
    assert raw["data"]["sources"] == [{"name": "code", "builtin": "humaneval"},
                                      {"name": "chat", "path": "chat.jsonl", "limit": 500}]
    with pytest.raises(ConfigError, match="'sources' has no entries named 'math'; its entries: "
                                          "code, chat"):
        apply_overrides(raw, ["data.sources.math.limit=5"])
    apply_overrides(raw, ["data.sources=[]"])  # the whole list, as before
    assert raw["data"]["sources"] == []


def test_load_config_overrides_are_validated(tmp_path):
    path = write_config(tmp_path, minimal_raw())
    config = load_config(path, ["train.epochs=2", "merge.dedup=no", "extract.aux_layer_ids=[0,2,4]",
                                "deploy.num_steps=2", "deploy.num_draft_tokens=3"])
    assert config.train.epochs == 2
    assert config.merge.dedup is False
    assert config.extract.aux_layer_ids == [0, 2, 4]
    assert (config.deploy.num_steps, config.deploy.num_draft_tokens) == (2, 3)
    with pytest.raises(ConfigError, match="train.epoch: unknown key"):
        load_config(path, ["train.epoch=2"])
    with pytest.raises(ConfigError, match=r"  train\.lr: "):
        load_config(path, ["train.lr=-1"])
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        load_config(path, ["train.lr"])


# --- deploy constraints: what SGLang refuses or crashes on (docs/engines/sglang.md) ------------


def test_eagle_algorithm_refused_for_eagle3_drafters(tmp_path):
    with pytest.raises(ValueError, match="EAGLE3"):
        DeployConfig(speculative_algorithm="EAGLE")
    path = write_config(tmp_path, minimal_raw(deploy={"speculative_algorithm": "EAGLE"}))
    with pytest.raises(ConfigError, match="deploy.speculative_algorithm='EAGLE'"):
        load_config(path)


def test_topk_one_requires_steps_plus_one_draft_tokens():
    assert DeployConfig(num_steps=5, eagle_topk=1, num_draft_tokens=6).num_draft_tokens == 6
    for tokens in (5, 7):
        with pytest.raises(ValueError, match=r"num_draft_tokens = num_steps \+ 1 = 6"):
            DeployConfig(num_steps=5, eagle_topk=1, num_draft_tokens=tokens)


def test_draft_token_budget_for_tree_drafting():
    # budget = topk + (steps - 1) * topk^2 = 2 + 2 * 4 = 10 -> at most 11 draft tokens
    assert DeployConfig(num_steps=3, eagle_topk=2, num_draft_tokens=11).num_draft_tokens == 11
    assert DeployConfig(num_steps=3, eagle_topk=2, num_draft_tokens=2).num_draft_tokens == 2
    with pytest.raises(ValueError, match="at most 11"):
        DeployConfig(num_steps=3, eagle_topk=2, num_draft_tokens=12)
    # steps=1: budget = topk
    assert DeployConfig(num_steps=1, eagle_topk=4, num_draft_tokens=5).num_draft_tokens == 5
    with pytest.raises(ValueError, match="at most 5"):
        DeployConfig(num_steps=1, eagle_topk=4, num_draft_tokens=6)


def test_deploy_error_through_load_config_names_key(tmp_path):
    raw = minimal_raw(deploy={"num_steps": 3, "eagle_topk": 1, "num_draft_tokens": 8})
    with pytest.raises(ConfigError, match=r"deploy\.num_draft_tokens=8"):
        load_config(write_config(tmp_path, raw))


# --- paths ---------------------------------------------------------------------------------------


def test_relative_data_paths_resolve_against_config_dir(tmp_path, monkeypatch):
    config_dir = tmp_path / "configs" / "nested"
    config_dir.mkdir(parents=True)
    raw = {"data": {"sources": [
        {"name": "rel", "path": "data.jsonl"},
        {"name": "up", "path": "../shared/more.jsonl"},
        {"name": "abs", "path": "/abs/file.jsonl"},
    ]}}
    path = write_config(config_dir, raw)
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    config = load_config(path)
    paths = [s.path for s in config.data.sources]
    assert paths == [
        str((config_dir / "data.jsonl").resolve()),
        str((tmp_path / "configs" / "shared" / "more.jsonl").resolve()),
        "/abs/file.jsonl",
    ]
    # Relative config path: same result.
    monkeypatch.chdir(tmp_path)
    config = load_config(Path("configs/nested/config.yaml"))
    assert [s.path for s in config.data.sources] == paths


def test_relative_run_root_resolves_against_cwd(tmp_path, monkeypatch):
    (tmp_path / "cfg").mkdir()
    path = write_config(tmp_path / "cfg", minimal_raw(run_root="runs/x"))
    monkeypatch.chdir(tmp_path)
    assert load_config(path).run_root == str(tmp_path / "runs" / "x")


# --- generate.endpoint ------------------------------------------------------------------------

def _with_generate(generate: dict) -> dict:
    return {"data": {"sources": [{"name": "s", "path": "x.jsonl"}]}, "generate": generate}


ENDPOINT = {"base_url": "http://127.0.0.1:30000/v1", "model": "m"}


def test_a_plain_api_key_in_the_config_is_refused_with_the_fix():
    with pytest.raises(ConfigError) as info:
        parse_config(_with_generate({"backend": "openai",
                                     "endpoint": {**ENDPOINT, "api_key": "sk-live-123"}}))
    message = str(info.value)
    assert "generate.endpoint.api_key" in message
    assert "api_key_env" in message and "api_key_secret" in message
    assert "sk-live-123" not in message  # the refusal does not echo the key


def test_endpoint_goes_with_the_openai_backend():
    with pytest.raises(ConfigError, match="backend=openai needs generate.endpoint"):
        parse_config(_with_generate({"backend": "openai"}))
    with pytest.raises(ConfigError, match="endpoint is set but generate.backend='transformers'"):
        parse_config(_with_generate({"endpoint": ENDPOINT}))
    config = parse_config(_with_generate({"backend": "openai", "endpoint": ENDPOINT}))
    assert [p.max_prompt_tokens for p in config.generate.endpoint.partitions] == [2048, 32768]


def test_partitions_must_ascend():
    partitions = [{"max_prompt_tokens": 8192, "concurrency": 4, "max_tokens": 512},
                  {"max_prompt_tokens": 1024, "concurrency": 64, "max_tokens": 512}]
    with pytest.raises(ConfigError, match=r"partitions: max_prompt_tokens must be distinct and "
                                          r"ascending \(got \[8192, 1024\]\)"):
        parse_config(_with_generate({"backend": "openai",
                                     "endpoint": {**ENDPOINT, "partitions": partitions}}))


def test_a_local_dataset_directory_resolves_against_the_config_file(tmp_path):
    (tmp_path / "datasets" / "mine").mkdir(parents=True)
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"data": {"sources": [
        {"name": "local", "hub": "datasets/mine"},
        {"name": "remote", "hub": "owner/name", "split": "test"}]}}))
    config = load_config(path)
    assert config.data.sources[0].hub == str(tmp_path / "datasets" / "mine")
    assert config.data.sources[1].hub == "owner/name"  # a hub name stays a name


# --- the export stage's old name, and drafting beyond the trained steps ------------------------


@pytest.mark.parametrize("section", ["fix_keys", "fix-keys", "export"])
def test_the_export_section_is_read_under_either_name(tmp_path, section):
    path = write_config(tmp_path, minimal_raw(**{section: {"format": "speculators"}}))
    config = load_config(path)
    assert config.export.format == "speculators" and config.fix_keys is config.export


def test_an_override_under_the_old_name_reaches_the_export_section(tmp_path):
    path = write_config(tmp_path, minimal_raw(export={"speculative_tokens": 2}))
    config = load_config(path, ["fix_keys.format=speculators"])
    assert (config.export.format, config.export.speculative_tokens) == ("speculators", 2)


def test_both_names_at_once_are_refused(tmp_path):
    path = write_config(tmp_path, minimal_raw(export={}, fix_keys={"format": "speculators"}))
    with pytest.raises(ConfigError, match="fix_keys and export are the same section"):
        load_config(path)


def test_drafting_more_steps_than_trained_is_warned_about():
    config = parse_config(minimal_raw(train={"ttt_steps": 2},
                                      deploy={"num_steps": 3, "num_draft_tokens": 4},
                                      export={"speculative_tokens": 3}))
    warnings = config.warnings()
    assert len(warnings) == 2
    assert warnings[0].startswith("deploy.num_steps=3 exceeds train.ttt_steps=2")
    assert warnings[1].startswith("export.speculative_tokens=3 exceeds train.ttt_steps=2")
    assert parse_config(minimal_raw()).warnings() == []  # the defaults draft what they train
