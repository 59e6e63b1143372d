"""Runs the generate stage in a child process from a JSON spec, so a test can kill -9 the
client itself mid-run (python tests/generate_child.py SPEC.json)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from draftsmith.artifacts import Descriptor, StagePlan
from draftsmith.config import DataConfig, GenerateConfig, TargetConfig
from draftsmith.generate.stage import run_generate

if __name__ == "__main__":
    spec = json.loads(Path(sys.argv[1]).read_text())
    run_generate(GenerateConfig.model_validate(spec["generate"]),
                 DataConfig.model_validate(spec["data"]),
                 TargetConfig.model_validate(spec["target_cfg"]),
                 Descriptor.model_validate(spec["target"]), StagePlan.model_validate(spec["plan"]),
                 backoff_initial_s=0.05, backoff_max_s=0.2)
