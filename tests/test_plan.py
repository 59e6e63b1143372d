"""draftsmith.plan: which stages run, and which settings each stage's cache key covers."""

from __future__ import annotations

import pytest

from draftsmith.config import ConfigError, PipelineConfig
from draftsmith.plan import data_descriptors, key_material, select_stages
from draftsmith.stages import names

STAGES = tuple(names())


def make_config(tmp_path, **sections) -> PipelineConfig:
    sources = []
    for name in ("alpha", "beta"):
        path = tmp_path / f"{name}.jsonl"
        if not path.exists():
            path.write_text(f'{{"id": "{name}", "messages": []}}\n')
        sources.append({"name": name, "path": str(path)})
    return PipelineConfig.model_validate({"data": {"sources": sources}, **sections})


def all_material(config: PipelineConfig) -> dict:
    return {stage: key_material(config, stage) for stage in STAGES}


# --- select_stages ------------------------------------------------------------------------------


def test_default_is_every_stage_in_order():
    assert select_stages() == list(STAGES)
    assert STAGES == ("generate", "merge", "extract", "train", "export", "deploy", "benchmark")


@pytest.mark.parametrize("name", ["export", "fix-keys", "fix_keys"])
def test_only_accepts_both_spellings(name):
    assert select_stages(only=name) == ["export"]


def test_from_and_to():
    assert select_stages(start="train") == ["train", "export", "deploy", "benchmark"]
    assert select_stages(stop="merge") == ["generate", "merge"]
    assert select_stages(start="extract", stop="fix-keys") == ["extract", "train", "export"]
    assert select_stages(start="fix-keys", stop="export") == ["export"]
    assert select_stages(start="generate", stop="benchmark") == list(STAGES)


@pytest.mark.parametrize(
    ("kwargs", "flag"),
    [({"only": "trian"}, "--only trian"), ({"start": "bench"}, "--from bench"),
     ({"stop": "fixkeys"}, "--to fixkeys")],
)
def test_unknown_stage_is_named_with_choices(kwargs, flag):
    with pytest.raises(ConfigError) as err:
        select_stages(**kwargs)
    message = str(err.value)
    assert message.startswith(f"{flag}: unknown stage")
    assert "generate, merge, extract, train, export, deploy, benchmark" in message


def test_bad_combinations():
    with pytest.raises(ConfigError, match="--only cannot be combined"):
        select_stages(only="train", start="merge")
    with pytest.raises(ConfigError, match="--only cannot be combined"):
        select_stages(only="train", stop="deploy")
    with pytest.raises(ConfigError, match="--from deploy comes after --to train"):
        select_stages(start="deploy", stop="train")


# --- key_material ------------------------------------------------------------------------------


def test_key_material_is_stable(tmp_path):
    assert all_material(make_config(tmp_path)) == all_material(make_config(tmp_path))


def test_benchmark_settings_change_only_benchmark_material(tmp_path):
    base = all_material(make_config(tmp_path))
    changed = all_material(make_config(tmp_path, benchmark={"num_prompts": 3,
                                                             "max_new_tokens": 7}))
    assert [s for s in STAGES if base[s] != changed[s]] == ["benchmark"]


@pytest.mark.parametrize(
    ("sections", "expected"),
    [
        ({"train": {"device": "cuda:1"}}, []),
        ({"train": {"log_every": 1}}, []),
        # Failure thresholds decide whether a stage passes, not what it writes: raising one
        # after a failure finishes from the journal under the same key.
        ({"generate": {"max_failure_rate": 0.5}}, []),
        ({"extract": {"writer_threads": 4, "data_parallel": 2}}, []),
        ({"deploy": {"startup_timeout_s": 5.0, "keep_serving": True}}, []),
        ({"export": {"format": "speculators"}}, ["export"]),
        ({"fix_keys": {"format": "speculators"}}, ["export"]),
        ({"target": {"context_length": 8192}}, ["export"]),
        ({"target": {"device": "cuda"}}, []),
        ({"train": {"lr": 1e-3}}, ["train"]),
        ({"merge": {"max_length": 64}}, ["merge"]),
        ({"extract": {"aux_layer_ids": [0, 2, 4]}}, ["extract"]),
        ({"generate": {"max_new_tokens": 9}}, ["generate"]),
        ({"deploy": {"num_steps": 2, "num_draft_tokens": 3}}, ["deploy"]),
        ({"target": {"dtype": "bfloat16"}}, ["generate", "extract", "deploy", "benchmark"]),
    ],
)
def test_which_stages_a_setting_reaches(tmp_path, sections, expected):
    base = all_material(make_config(tmp_path))
    changed = all_material(make_config(tmp_path, **sections))
    assert [s for s in STAGES if base[s] != changed[s]] == expected


def test_generate_material_covers_sources_but_not_their_paths(tmp_path):
    config = make_config(tmp_path)
    base = key_material(config, "generate")
    config.data.sources[0].limit = 5
    assert key_material(config, "generate") != base
    config.data.sources[0].limit = None
    config.data.sources[0].path = str(tmp_path / "moved.jsonl")
    assert key_material(config, "generate") == base  # content is covered by data_descriptors


def test_key_material_unknown_stage(tmp_path):
    with pytest.raises(ValueError, match="unknown stage 'fix-keys'"):
        key_material(make_config(tmp_path), "fix-keys")


# --- data_descriptors --------------------------------------------------------------------------


def test_data_fingerprint_follows_content(tmp_path):
    config = make_config(tmp_path)
    first = data_descriptors(config)
    assert [d.path for d in first] == [s.path for s in config.data.sources]
    assert first[0].fingerprint != first[1].fingerprint
    assert [d.fingerprint for d in data_descriptors(config)] == [d.fingerprint for d in first]

    (tmp_path / "beta.jsonl").write_text('{"id": "beta", "messages": ["changed"]}\n')
    second = data_descriptors(config)
    assert second[0].fingerprint == first[0].fingerprint
    assert second[1].fingerprint != first[1].fingerprint


def test_missing_data_file_names_the_source(tmp_path):
    config = make_config(tmp_path)
    (tmp_path / "beta.jsonl").unlink()
    with pytest.raises(ConfigError) as err:
        data_descriptors(config)
    message = str(err.value)
    assert "data.sources[beta]" in message
    assert str(tmp_path / "beta.jsonl") in message
    assert "not found" in message


def test_endpoint_settings_that_change_no_answer_keep_the_generate_key(tmp_path):
    """Moving the server, driving it harder or changing its price must not throw away a long
    regeneration; the model, the partitions' prompt bounds and completion budgets must."""
    endpoint = {"base_url": "http://a:1/v1", "model": "m", "partitions": [
        {"max_prompt_tokens": 100, "concurrency": 4, "max_tokens": 50}]}
    base = make_config(tmp_path, generate={"backend": "openai", "endpoint": endpoint})
    material = key_material(base, "generate")
    for change in ({"base_url": "http://b:2/v1"}, {"timeout_s": 5}, {"max_retries": 0},
                   {"api_key_env": "K"}, {"price_per_1m_prompt_tokens": 1.0},
                   {"partitions": [{**endpoint["partitions"][0], "concurrency": 64}]}):
        config = make_config(tmp_path, generate={"backend": "openai",
                                                 "endpoint": {**endpoint, **change}})
        assert key_material(config, "generate") == material, change
    for change in ({"model": "other"},
                   {"partitions": [{**endpoint["partitions"][0], "max_tokens": 51}]}):
        config = make_config(tmp_path, generate={"backend": "openai",
                                                 "endpoint": {**endpoint, **change}})
        assert key_material(config, "generate") != material, change


def test_hub_sources_are_fingerprinted_by_name_or_by_directory_content(tmp_path):
    from draftsmith.config import DataSource

    hub = make_config(tmp_path)
    hub.data.sources[0] = DataSource(name="alpha", hub="owner/dataset")
    first = data_descriptors(hub)[0].fingerprint
    hub.data.sources[0].revision = "abc123"
    assert data_descriptors(hub)[0].fingerprint != first
    directory = tmp_path / "ds"
    (directory / "data").mkdir(parents=True)
    (directory / "data" / "train.jsonl").write_text('{"prompt": "a"}\n')
    hub.data.sources[0].hub = str(directory)
    before = data_descriptors(hub)[0].fingerprint
    (directory / "data" / "train.jsonl").write_text('{"prompt": "b"}\n')
    assert data_descriptors(hub)[0].fingerprint != before
