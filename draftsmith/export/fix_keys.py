"""Stage `fix-keys`: export the trained drafter to the serving engine's layout and validate it."""

from __future__ import annotations

import logging
from pathlib import Path

from safetensors.torch import load_file

from draftsmith.artifacts import Descriptor, StagePlan, finish_stage, stage_output
from draftsmith.config import FixKeysConfig
from draftsmith.export.native import WEIGHTS_FILE, read_native_meta
from draftsmith.export.sglang import export_sglang
from draftsmith.model.eagle3 import Eagle3Config

log = logging.getLogger(__name__)

DRAFTER_DIR = "drafter"


def run_fix_keys(cfg: FixKeysConfig, trained: Descriptor, target: Descriptor,
                 plan: StagePlan) -> Descriptor:
    meta = read_native_meta(trained.path)
    drafter_cfg = Eagle3Config.model_validate(meta["config"])
    state = load_file(str(Path(trained.path) / WEIGHTS_FILE))
    family = target.figures["family"]
    with stage_output(plan) as out:
        config = export_sglang(state, drafter_cfg, family, out / DRAFTER_DIR)
    ids = config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    log.info("fix-keys: %s drafter written to %s and validated; aux layers %s (outputs) are "
             "written as %s for a %s-family target", cfg.format, out / DRAFTER_DIR,
             drafter_cfg.aux_layer_ids, ids, family)
    return finish_stage(plan, figures={
        "format": cfg.format, "drafter_dir": str(out / DRAFTER_DIR),
        "canonical_aux_layer_ids": drafter_cfg.aux_layer_ids, "sglang_aux_layer_ids": ids,
        "target_family": family,
    })
