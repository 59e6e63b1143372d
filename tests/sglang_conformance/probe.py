"""Runs inside the SGLang test environment (tests/sglang_conformance/env.py), one command per
process, and prints one JSON object. tests/test_sglang_conformance.py drives it.

    parse     stdin: {"launches": [{"name", "launch": SGLangLaunch}], "fields": [...],
              "parsers": [...] (optional)}.
              Each launch goes through draftsmith's check_with_sglang_parser (which finds
              sglang importable here) and through SGLang's own prepare_server_args, the
              function `python -m sglang.launch_server` calls; reports the named ServerArgs
              fields, or the error; and what `parsers` reports for each reasoning parser
              named (one SGLang import for all of it).
    registry  SGLang's model registry imported with SGLANG_EXTERNAL_MODEL_PACKAGE set (by the
              caller); reports which class serves DRAFTSMITH_CAPTURE_ARCH, builds it on TP
              ranks 0 and 1, runs one forward and reports the dump it wrote.
    parsers   the reasoning parsers SGLang knows and the think tags of the named one.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import sys
from pathlib import Path

STANDIN_MODELS = Path(__file__).resolve().parent / "standin_models"


def parse() -> dict:
    from sglang.srt.server_args import prepare_server_args

    from draftsmith.serve.engine_adapter import LaunchError
    from draftsmith.serve.sglang_launch import (
        SGLangLaunch,
        check_with_sglang_parser,
        server_arguments,
    )

    request = json.load(sys.stdin)
    results = []
    for item in request["launches"]:
        launch = SGLangLaunch.model_validate(item["launch"])
        result = {"name": item["name"]}
        try:
            result["deprecated"] = check_with_sglang_parser(launch)
        except LaunchError as err:
            result["error"] = str(err)
            results.append(result)
            continue
        errors = io.StringIO()
        try:
            with contextlib.redirect_stderr(errors):
                args = prepare_server_args(server_arguments(launch))
        except SystemExit:
            result["error"] = errors.getvalue().strip()[-2000:]
        else:
            result["fields"] = {f: getattr(args, f) for f in request["fields"]}
        results.append(result)
    return {"results": results,
            "parsers": {name: reasoning_parser(name) for name in request.get("parsers", [])}}


def registry() -> dict:
    warnings: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                warnings.append(record.getMessage())

    logging.getLogger().addHandler(Collect())
    import sglang.srt.models as builtin_models

    builtin_models.__path__.append(str(STANDIN_MODELS))  # SGLang's CPU-less built-ins
    from sglang.srt.models.registry import ModelRegistry
    from sglang.srt.runtime_context import get_parallel

    arch = os.environ["DRAFTSMITH_CAPTURE_ARCH"]
    served_before_defaults = ModelRegistry.models.get(arch)
    cls, resolved_arch = ModelRegistry.resolve_model_cls([arch])
    ModelRegistry.get_supported_archs()  # loads SGLang's own models into the registry
    after_defaults = ModelRegistry.models[arch]
    report = {
        "arch": resolved_arch, "module": cls.__module__, "name": cls.__name__,
        "bases": [f"{b.__module__}.{b.__name__}" for b in cls.__mro__[1:3]],
        "registered_before_defaults": served_before_defaults is cls,
        "serves_after_defaults": after_defaults is cls,
        "warnings": [w for w in warnings if "draftsmith" in w],
    }
    if not cls.__module__.startswith("draftsmith."):
        return report
    import types

    import torch
    from safetensors import safe_open

    from draftsmith.extract.sglang_dump import CaptureLogitsProcessor, capture_owner

    ranks = {}
    for rank in (0, 1):
        with get_parallel().override(tp_rank=rank):
            model = cls()
        owner = capture_owner(model)
        processor = owner.logits_processor
        ranks[rank] = {"writer": isinstance(processor, CaptureLogitsProcessor)
                       and processor.is_writer_rank,
                       "layers_to_capture": owner.model.layers_to_capture,
                       "owner": type(owner).__name__}
        if rank == 0:
            writer_model = model
    report["ranks"] = ranks
    seq_lens = [5, 3]
    ids = torch.arange(1, 1 + sum(seq_lens))  # [N]
    batch = types.SimpleNamespace(
        forward_mode=types.SimpleNamespace(is_extend=lambda: True,
                                           is_target_verify=lambda: False),
        input_ids=ids, extend_seq_lens_cpu=seq_lens, extend_prefix_lens_cpu=[0, 0],
        rids=["probe-a", "probe-b"])
    writer_model(ids, None, batch)
    capture_owner(writer_model).logits_processor.writer.close()
    dumps = {}
    for rid in ("probe-a", "probe-b"):
        path = Path(os.environ["DRAFTSMITH_CAPTURE_DIR"]) / f"rid-{rid}.safetensors"
        if path.is_file():
            with safe_open(str(path), framework="pt") as f:
                dumps[rid] = {k: list(f.get_tensor(k).shape) for k in f.keys()}  # noqa: SIM118
                dumps[rid]["input_ids"] = f.get_tensor("input_ids").tolist()
                dumps[rid]["metadata"] = f.metadata()
    report["dumps"] = dumps
    return report


def parsers() -> dict:
    return reasoning_parser(sys.argv[2])


def reasoning_parser(name: str) -> dict:
    from sglang.srt.parser.reasoning_parser import ReasoningParser

    detector = ReasoningParser.DetectorMap[name]()
    return {"names": sorted(ReasoningParser.DetectorMap), "detector": type(detector).__name__,
            "think_start": detector.think_start_token, "think_end": detector.think_end_token}


if __name__ == "__main__":
    command = {"parse": parse, "registry": registry, "parsers": parsers}[sys.argv[1]]
    output = command()
    print("\n@@probe@@" + json.dumps(output, default=str))
