"""The demo's pipeline, smaller, through the real Prefect flow on the trained tiny target: run
once per session (tests/conftest.py `tiny_run`) and shared by the e2e tests, which check and
then rerun it, and the vLLM tests, which serve the drafter it trained (tests/vllm_chain.py).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import yaml

from draftsmith.config import parse_config
from tests.conftest import REPO

# Records read from each of the two example sources, and the answers' length: enough for a
# drafter that pays (acceptance > 1.5 on the embedded engine and on vLLM).
RECORDS_PER_SOURCE = 48
MAX_NEW_TOKENS = 64


def base_config(root: Path) -> dict:
    """examples/tiny.yaml, smaller: fewer records and epochs, data copied so a test can edit
    it."""
    data_dir = root / "data"
    data_dir.mkdir(parents=True)
    raw = yaml.safe_load((REPO / "examples" / "tiny.yaml").read_text())
    for source in raw["data"]["sources"]:
        copy = data_dir / os.path.basename(source["path"])
        shutil.copy(REPO / "examples" / source["path"], copy)
        source["path"] = str(copy)
        source["limit"] = RECORDS_PER_SOURCE
    raw["run_root"] = str(root / "runs" / "tiny")
    raw["generate"]["max_new_tokens"] = MAX_NEW_TOKENS
    raw["merge"]["validation_fraction"] = 0.15  # 8+ held-out prompts of the 96 records
    raw["train"]["epochs"] = 6
    raw["benchmark"]["num_prompts"] = 8
    return raw


def run_pipeline(raw: dict, stages: list[str] | None = None) -> dict[str, dict]:
    """The flow as `draftsmith run` starts it: the whole config in full_config."""
    from flows.pipeline import pipeline

    parse_config(json.loads(json.dumps(raw)))  # a bad test config fails here, not in Prefect
    return pipeline(full_config=raw, stages=stages or [])


# The drafter kinds' CPU smoke runs (tests/test_drafter_kinds.py, served by
# tests/test_vllm_kinds.py): the session run's config with one `drafter` setting changed and
# the export for vLLM. generate, merge and extract are the session run's, from the cache.
KIND_SETTINGS = {
    # EAGLE-3.1 as speculators 0.9.0 trains it by default, with an MLP twice the tiny
    # target's (384): vLLM must build its drafter from the exported config, not the target's.
    "eagle3.1": {"norm_before_residual": True, "norm_before_fc": True, "norm_output": True,
                 "intermediate_size": 768},
    # DFlash with a block of 4 (three drafts a round, as the session run's chain of 3) and one
    # layer: vLLM 0.32's CPU runner norms every layer's context keys with layer 0's k_norm
    # (tests/test_vllm_kinds.py pins it), so only a one-layer DFlash runs there as trained.
    "dflash": {"kind": "dflash", "dflash": {"block_size": 4, "num_layers": 1}},
}


def kind_config(raw: dict, kind: str) -> dict:
    """`raw` (the session run's config) with drafter kind `kind` and the speculators export."""
    raw = json.loads(json.dumps(raw))
    raw["drafter"] = KIND_SETTINGS[kind]
    raw["export"] = {**raw.get("export", {}), "format": "speculators"}
    return raw
