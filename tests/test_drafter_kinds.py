"""One setting, drafter.kind (with EAGLE-3.1's norms as options), read by every stage: the
real Prefect flow on the tiny target for EAGLE-3.1 and for DFlash, from the session run's
cached data to a lossless embedded benchmark. The registry and the config checks that make a
kind's impossible settings fail before anything runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from draftsmith.config import ConfigError, parse_config
from draftsmith.export.convert import read_drafter
from draftsmith.model.kinds import KINDS, kind_named
from draftsmith.stages import names

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(2400)]  # the session run comes first
STAGES = tuple(names())
UPSTREAM = ("generate", "merge", "extract")


def descriptor(run: dict, stage: str) -> dict:
    return run[stage]["descriptor"]


def check_kind_run(run: dict, tiny_run: dict) -> None:
    """The stages before train are the session run's (cached); train and everything after it
    ran for this kind, and the embedded benchmark is lossless."""
    assert {s: run[s]["state"] for s in UPSTREAM} == dict.fromkeys(UPSTREAM, "Cached")
    assert {s: run[s]["state"] for s in STAGES[3:]} == dict.fromkeys(STAGES[3:], "Completed")
    for stage in UPSTREAM:
        assert descriptor(run, stage)["fingerprint"] == descriptor(tiny_run, stage)["fingerprint"]
    assert descriptor(run, "train")["path"] != descriptor(tiny_run, "train")["path"]
    bench = descriptor(run, "benchmark")["figures"]
    assert bench["lossless"] is True and bench["identical_outputs"] == "8/8"
    assert descriptor(run, "deploy")["figures"]["smoke_acceptance_length"] >= 1


def test_eagle31_runs_through_the_pipeline(eagle31_run, tiny_run):
    check_kind_run(eagle31_run, tiny_run)
    trained = read_drafter(descriptor(eagle31_run, "train")["path"])
    assert trained.kind == "eagle3"
    assert trained.config.norm_flags == {"norm_before_residual": True, "norm_before_fc": True,
                                         "fc_norm": False, "norm_output": True}
    exported = Path(descriptor(eagle31_run, "export")["figures"]["drafter_dir"])
    config = json.loads((exported / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3"
    assert (config["norm_before_residual"], config["norm_before_fc"], config["norm_output"]) \
        == (True, True, True)
    # drafter.intermediate_size (tests/tiny_run.py): the MLP is twice the target's, and the
    # exported layer config says so (vLLM builds the drafter from it: test_vllm_kinds.py).
    assert trained.config.intermediate_size == 768
    assert trained.tensors["midlayer.mlp.gate_proj.weight"].shape[0] == 768
    assert config["transformer_layer_config"]["intermediate_size"] == 768
    bench = descriptor(eagle31_run, "benchmark")["figures"]
    assert bench["acceptance_length"] > 1.5  # trained: drafts are accepted
    print(f"EAGLE-3.1 embedded acceptance {bench['acceptance_length']} (EAGLE-3: "
          f"{descriptor(tiny_run, 'benchmark')['figures']['acceptance_length']})")


def test_dflash_runs_through_the_pipeline(dflash_run, tiny_run):
    check_kind_run(dflash_run, tiny_run)
    trained = read_drafter(descriptor(dflash_run, "train")["path"])
    assert trained.kind == "dflash" and trained.config.block_size == 4
    train = descriptor(dflash_run, "train")["figures"]
    assert train["tau"] > 1.0 and "full_acc_2" in train  # three drafted block positions
    exported = Path(descriptor(dflash_run, "export")["figures"]["drafter_dir"])
    config = json.loads((exported / "config.json").read_text())
    assert config["speculators_model_type"] == "dflash" and config["block_size"] == 4
    bench = descriptor(dflash_run, "benchmark")["figures"]
    assert bench["acceptance_length"] > 1.0  # trained: some drafts are accepted
    print(f"DFlash embedded acceptance {bench['acceptance_length']}, train tau {train['tau']}")


# --------------------------------------------------------------------------- the one switch


def raw_config(**sections) -> dict:
    return {"data": {"sources": [{"name": "d", "path": "x.jsonl"}]}, **sections}


def test_every_kind_is_one_registry_entry():
    assert set(KINDS) == {"eagle3", "dflash"}
    for name, kind in KINDS.items():
        assert kind.name == name and callable(kind.row_loss())
        assert kind_named(name) is kind
    assert (kind_named("eagle3").vllm_method, kind_named("dflash").vllm_method) == \
        ("eagle3", "dflash")


def test_what_a_kind_cannot_run_is_refused_when_the_config_loads():
    with pytest.raises(ConfigError, match="EAGLE-3.1 options"):
        parse_config(raw_config(drafter={"kind": "dflash", "norm_output": True}))
    with pytest.raises(ConfigError, match="export.format=speculators"):
        parse_config(raw_config(drafter={"kind": "dflash"}))
    dflash = {"drafter": {"kind": "dflash", "dflash": {"block_size": 4}},
              "export": {"format": "speculators"}}
    with pytest.raises(ConfigError, match="at most block_size - 1 = 3"):
        parse_config(raw_config(**dflash, deploy={"num_steps": 4, "eagle_topk": 1,
                                                  "num_draft_tokens": 5}))
    with pytest.raises(ConfigError, match="deploy.engine=vllm or embedded"):
        parse_config(raw_config(**dflash, deploy={"engine": "sglang"}))
    # SGLang 0.5.23 runs EAGLE-3.1's norms but norm_before_residual.
    with pytest.raises(ConfigError, match="SGLang 0.5.23 always keeps the residual"):
        parse_config(raw_config(drafter={"norm_before_residual": True},
                                export={"format": "sglang"}))
    parse_config(raw_config(drafter={"norm_before_fc": True, "fc_norm": True,
                                     "norm_output": True}, export={"format": "sglang"}))
    ok = parse_config(raw_config(**dflash, deploy={"engine": "vllm", "num_steps": 3,
                                                   "eagle_topk": 1, "num_draft_tokens": 4}))
    assert ok.drafter.kind == "dflash" and ok.warnings() == []
