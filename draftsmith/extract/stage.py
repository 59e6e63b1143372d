"""Stage `extract`: run the target over the merged data and store its hidden states."""

from __future__ import annotations

import logging

import torch

from draftsmith.artifacts import Descriptor, StagePlan, finish_stage, stage_output
from draftsmith.config import ExtractConfig, TargetConfig
from draftsmith.data.merge import SPLITS, read_split
from draftsmith.extract.capture import HiddenStateCapture
from draftsmith.extract.store import Sample, ShardWriter, write_index
from draftsmith.progress import Progress
from draftsmith.target import (
    DTYPES,
    check_aux_layer_ids,
    default_aux_layer_ids,
    load_target_model,
)

log = logging.getLogger(__name__)


def aux_layer_ids_for(cfg: ExtractConfig, target: Descriptor) -> list[int]:
    num_layers = target.figures["num_layers"]
    ids = cfg.aux_layer_ids if cfg.aux_layer_ids is not None else default_aux_layer_ids(num_layers)
    return check_aux_layer_ids(list(ids), num_layers)


def run_extract(cfg: ExtractConfig, target_cfg: TargetConfig, merged: Descriptor,
                target: Descriptor, plan: StagePlan) -> Descriptor:
    if cfg.backend != "transformers":
        raise NotImplementedError(
            f"extract.backend={cfg.backend!r} is not available yet; use 'transformers'"
        )
    aux_ids = aux_layer_ids_for(cfg, target)
    model = load_target_model(target.path, target_cfg.device, target_cfg.dtype)
    capture = HiddenStateCapture(model, aux_ids)
    store_dtype = DTYPES[cfg.dtype]
    meta = {"target_fingerprint": target.fingerprint, "aux_layer_ids": aux_ids,
            "hidden_size": target.figures["hidden_size"], "dtype": cfg.dtype,
            "layer_id_convention": "output of decoder layer i (= transformers hidden_states[i+1])"}
    splits: dict[str, list[dict]] = {}
    tokens = 0
    with stage_output(plan) as out:
        for split in SPLITS:
            rows = sorted(read_split(merged, split), key=lambda r: len(r["input_ids"]))
            writer = ShardWriter(out, split, cfg.shard_tokens)
            progress = Progress(f"extract {split}", total=len(rows), unit="sample")
            for start in range(0, len(rows), cfg.batch_size):
                batch = rows[start:start + cfg.batch_size]
                lengths = [len(r["input_ids"]) for r in batch]
                input_ids = torch.zeros(len(batch), max(lengths), dtype=torch.long)  # [B, T]
                attention_mask = torch.zeros_like(input_ids)  # [B, T]
                for i, r in enumerate(batch):
                    input_ids[i, : lengths[i]] = torch.tensor(r["input_ids"])
                    attention_mask[i, : lengths[i]] = 1
                aux, final = capture(input_ids.to(model.device), attention_mask.to(model.device))
                for i, r in enumerate(batch):
                    n = lengths[i]
                    writer.add(Sample(
                        id=r["id"],
                        input_ids=input_ids[i, :n].clone(),
                        loss_mask=torch.tensor(r["loss_mask"], dtype=torch.uint8),
                        aux=aux[i, :n].to("cpu", store_dtype).clone(),  # [T, K*H]
                        final=final[i, :n].to("cpu", store_dtype).clone(),  # [T, H]
                    ))
                tokens += sum(lengths)
                progress.update(len(batch), tokens=tokens)
            progress.close()
            splits[split] = writer.close()
        write_index(out, meta, splits)
    log.info("extract: %d tokens, aux layers %s (outputs of those decoder layers)", tokens, aux_ids)
    shards = [shard for split_shards in splits.values() for shard in split_shards]
    return finish_stage(
        plan,
        counts={"tokens": tokens, "samples": sum(len(s["ids"]) for s in shards)},
        figures={"aux_layer_ids": aux_ids, "dtype": cfg.dtype},
        known_checksums={s["file"]: s["sha256"] for s in shards},
    )
