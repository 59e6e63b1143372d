"""Stage `generate`: read every source, answer the prompts that need an answer with the target.

The drafter can only learn the target's own distribution, so prompt-only records are answered
by the target itself (and with `regenerate: all`, every record's last answer is replaced).
"""

from __future__ import annotations

import json
import logging

from draftsmith.artifacts import Descriptor, StagePlan, finish_stage, stage_output
from draftsmith.config import DataConfig, GenerateConfig, TargetConfig
from draftsmith.data.formats import Message, Record, SourceStats, load_source
from draftsmith.progress import Progress

log = logging.getLogger(__name__)

RECORDS_FILE = "records.jsonl"


def _prompt_part(record: Record, mode: str) -> list[Message] | None:
    """The turns to send to the target, or None when the record is kept as it is."""
    if mode == "none":
        return None
    if record.needs_answer():
        return record.messages
    if mode == "all":
        return record.messages[:-1]
    return None


def run_generate(cfg: GenerateConfig, data: DataConfig, target_cfg: TargetConfig,
                 target: Descriptor, plan: StagePlan) -> Descriptor:
    records: list[Record] = []
    stats: list[SourceStats] = []
    for source in data.sources:
        source_records, source_stats = load_source(source.name, source.path, source.format,
                                                   source.limit, data.max_drop_rate)
        log.info("source %s: read %d, kept %d, dropped %s", source.name, source_stats.read,
                 source_stats.kept, source_stats.dropped or "none")
        records += source_records
        stats.append(source_stats)

    todo = [(i, prompt) for i, r in enumerate(records)
            if (prompt := _prompt_part(r, cfg.regenerate)) is not None]
    if todo and cfg.backend != "transformers":
        raise NotImplementedError(
            f"generate.backend={cfg.backend!r} is not available yet; use 'transformers' "
            "(in-process) for now"
        )
    completion_tokens = stopped = 0
    with stage_output(plan) as out:
        if todo:
            from draftsmith.generate.transformers_backend import TransformersGenerator
            from draftsmith.target import load_target_model, load_tokenizer

            generator = TransformersGenerator(
                load_target_model(target.path, target_cfg.device, target_cfg.dtype),
                load_tokenizer(target),
                max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                top_p=cfg.top_p, seed=cfg.seed,
            )
            # Similar lengths per batch keep left-padding waste small.
            todo.sort(key=lambda item: sum(len(m.content) for m in item[1]))
            progress = Progress("generate", total=len(todo), unit="request")
            for start in range(0, len(todo), cfg.batch_size):
                batch = todo[start:start + cfg.batch_size]
                answers = generator.complete(
                    [[m.model_dump(include={"role", "content"}) for m in p] for _, p in batch]
                )
                for (index, prompt), answer in zip(batch, answers, strict=True):
                    records[index] = records[index].model_copy(update={"messages": [
                        *prompt, Message(role="assistant", content=answer.text)]})
                    completion_tokens += answer.completion_tokens
                    stopped += answer.finish_reason == "stop"
                progress.update(len(batch), tokens=completion_tokens)
            progress.close()
        with open(out / RECORDS_FILE, "w") as f:
            for record in records:
                f.write(record.model_dump_json(exclude_none=True) + "\n")
        (out / "stats.json").write_text(json.dumps([s.model_dump() for s in stats], indent=2))
    log.info("generate: %d records, %d answered by the target (%d completion tokens, %d ended "
             "their turn)", len(records), len(todo), completion_tokens, stopped)
    return finish_stage(plan, counts={"records": len(records), "generated": len(todo),
                                      "completion_tokens": completion_tokens,
                                      "finished_turns": stopped})


def read_records(generated: Descriptor) -> list[Record]:
    with open(generated.dir / RECORDS_FILE) as f:
        return [Record.model_validate_json(line) for line in f]
