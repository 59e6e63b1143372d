"""What torch.compile compiles, and why, in the benchmark stage's embedded measurement
(plain_decoding, measure_embedded at batch 1, then measure_batched at each --batch-sizes), with
the static path's compiled steps forced on the CPU: SmolLM2's shapes with random weights and
--layers decoder layers (the real target has 30; fewer keeps the CPU's compile time sane and
changes no graph count: every layer is traced into the same graph).

Per phase: torch._dynamo's counters, every frame compile (function, compile id, why it
recompiled, graph breaks, ops, seconds) from torch._dynamo.utils.get_compilation_metrics, the
symbols that dynamic shapes made (and for which input dims), and the phase's wall time. Tokens
are checked against eager plain greedy decoding (a dynamic cache, nothing compiled).

Off CUDA the engine compiles nothing (compiling.cuda_graphs); --force-compile (the default)
patches embedded.cuda_graphs to say yes, so the steps are compiled as on CUDA and replayed
without graphs (CapturedStep with graphs=False). --variant tries a fix without touching the
engine's code: `dynamic` compiles with dynamic=True, `mark-batch` marks the batch dim (and the
static caches') dynamic before a batched step's first call. (A `static` variant, dynamic=False,
is what the engine's CapturedStep does since 2026-12-07.)

    TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) PYTHONPATH=. python \\
        benchmarks/gpu_speculative/compile_counts.py --variant baseline --out /tmp/cc.json

Counts transfer to CUDA (dynamo and the guards are the same); seconds do not (inductor makes
C++ here and Triton kernels there, whose compile times differ).
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import sys
import time
import types
from pathlib import Path

import torch
from torch.utils._pytree import tree_flatten
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from random_parts import CONFIG, DRAFT_VOCAB, dev_length_prompts  # noqa: E402

import draftsmith.compiling as compiling  # noqa: E402
import draftsmith.serve.embedded as embedded  # noqa: E402
from draftsmith.bench.benchmark import (  # noqa: E402
    decode_again,
    measure_batched,
    measure_embedded,
    plain_decoding,
)
from draftsmith.config import BenchmarkConfig  # noqa: E402
from draftsmith.model.aux_hooks import decoder_of  # noqa: E402
from draftsmith.model.eagle3.model import Eagle3Config, Eagle3Drafter  # noqa: E402
from draftsmith.serve.embedded import (  # noqa: E402
    EmbeddedSpeculativeEngine,
    TargetRunner,
    plain_generate,
)

VARIANTS = ("baseline", "dynamic", "mark-batch", "regional")


def parts(layers: int) -> tuple[LlamaForCausalLM, Eagle3Drafter]:
    """random_parts' target and drafter with `layers` decoder layers, the aux layers spread as
    the recipe's (1, L//2 - 1, L - 4 of 30) as far as so few layers allow."""
    config = json.loads(CONFIG.read_text())
    config["num_hidden_layers"] = layers
    aux = sorted({min(1, layers - 1), max(layers // 2 - 1, 0), max(layers - 1, 0)})
    aux = aux if len(aux) == 3 else list(range(3))
    torch.manual_seed(0)
    fields = {k: v for k, v in config.items() if k not in ("architectures", "model_type")}
    target = LlamaForCausalLM(LlamaConfig(**fields)).eval()
    shape = Eagle3Config.from_target(config, aux, DRAFT_VOCAB, norm_before_fc=True,
                                     norm_before_residual=True, norm_output=True)
    torch.manual_seed(0)
    drafter = Eagle3Drafter(shape)
    in_draft_vocab = torch.zeros(shape.vocab_size, dtype=torch.bool)
    in_draft_vocab[:DRAFT_VOCAB] = True
    drafter.load_target_parts(target.get_input_embeddings().weight.detach(),
                              torch.zeros(DRAFT_VOCAB, dtype=torch.int64), in_draft_vocab)
    return target, drafter.eval()


class Records(logging.Handler):
    """The torch log records of interest, kept until taken."""

    KEEP = ("Recompiling function", "Graph break", "graph break", "create_symbol",
            "marking", "recompile_limit", "cache_size_limit", "set_replacement")

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a record that cannot format is not ours to fix
            return
        if any(k in message for k in self.KEEP) or record.levelno >= logging.WARNING:
            self.lines.append(f"{record.name}: {message[:600]}")

    def take(self) -> list[str]:
        lines, self.lines = self.lines, []
        return list(dict.fromkeys(lines))  # once each: a record may reach two handlers


def _batched_leaves(args: tuple, kwargs: dict) -> list[torch.Tensor] | None:
    """The tensors of a batched step's arguments and of any cache among them (StaticCache
    layers' keys and values) when they share a leading dim > 1 (the batch); else None (a batch
    of one, or greedy_round_steps' packed ids, whose dim 0 is no batch)."""
    leaves = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)]
    for value in [*args, *kwargs.values()]:
        for layer in getattr(value, "layers", []) or []:
            leaves += [t for t in (getattr(layer, "keys", None), getattr(layer, "values", None))
                       if isinstance(t, torch.Tensor)]
    sizes = {t.shape[0] for t in leaves if t.dim() > 0}
    if len(sizes) == 1 and sizes.pop() > 1:
        return [t for t in leaves if t.dim() > 0]
    return None


def marking_batch(compiled):
    """compiled, with the batch dim of a batched call's tensors marked dynamic first."""
    def call(*args, **kwargs):
        for tensor in _batched_leaves(args, kwargs) or []:
            torch._dynamo.mark_dynamic(tensor, 0)
        return compiled(*args, **kwargs)
    call.__name__ = getattr(compiled, "__name__", "compiled")
    return call


def patch(variant: str, force: bool) -> None:
    """Make the engine compile on the CPU (force) and apply the variant."""
    if force:
        embedded.cuda_graphs = lambda device: True  # steps compiled; CapturedStep graphs=False
    real = compiling.compiled_once
    if variant == "dynamic":
        embedded.compiled_once = lambda fn, **o: real(fn, dynamic=True, **o)
    elif variant == "mark-batch":
        embedded.compiled_once = lambda fn, **o: marking_batch(real(fn, **o))
    elif variant == "regional":
        embedded.StaticTargetRunner._compiled_step = _regional_step


def _regional_step(self, ids: torch.Tensor, cache, **extra):
    """StaticTargetRunner._compiled_step compiling each decoder layer (one compiled code
    object for all of them) instead of the whole forward; the rest of the forward is eager."""
    layers = list(decoder_of(self.model).layers)
    compiled = compiling.compiled_once(type(layers[0]).forward)
    for layer in layers:
        layer.forward = types.MethodType(compiled, layer)
    try:
        return self._step_through(self.model.forward, ids, cache, **extra)
    finally:
        for layer in layers:
            del layer.forward


def compiles_since(seen: int) -> list[dict]:
    out = []
    for m in torch._dynamo.utils.get_compilation_metrics()[seen:]:
        out.append({
            "id": m.compile_id, "fn": f"{m.co_name} {Path(m.co_filename or '?').name}:"
                                      f"{m.co_firstlineno}",
            "recompile_reason": m.recompile_reason, "graph_breaks": m.num_graph_breaks,
            "ops": m.graph_op_count, "seconds": m.entire_frame_compile_time_s,
            "inductor_s": m.inductor_compile_time_s, "fail": m.fail_type,
            "restarts": sorted(m.restart_reasons or [])})
    return out


def counter_diff(before: dict, after: dict) -> dict:
    diff = {}
    for group, values in after.items():
        changed = {k: v - before.get(group, {}).get(k, 0) for k, v in values.items()
                   if v != before.get(group, {}).get(k, 0)}
        if changed:
            diff[group] = changed
    return diff


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", default="baseline", choices=VARIANTS)
    parser.add_argument("--no-force-compile", dest="force", action="store_false")
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--batch-sizes", type=int, nargs="*", default=[4, 16])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="the target's and drafter's (the benchmark's target.dtype)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    torch.set_num_threads(max(torch.get_num_threads(), 1))
    records = Records()
    torch._logging.set_logs(recompiles=True, graph_breaks=True, dynamic=logging.INFO)
    # torch's own loggers do not propagate to "torch": the handler goes on each.
    for name, logger in [("torch", logging.getLogger("torch")),
                         *logging.Logger.manager.loggerDict.items()]:
        if name.startswith("torch") and isinstance(logger, logging.Logger):
            logger.addHandler(records)
    torch._dynamo.utils.set_compilation_metrics_limit(10_000)

    target, drafter = parts(args.layers)
    target, drafter = target.to(getattr(torch, args.dtype)), drafter.to(getattr(torch, args.dtype))
    prompts = dev_length_prompts(args.prompts)
    cfg = BenchmarkConfig(num_prompts=args.prompts, max_new_tokens=args.max_new_tokens,
                          warmup_prompts=1)
    started = time.perf_counter()
    reference_runner = TargetRunner(target, drafter.config.aux_layer_ids)
    with torch.inference_mode():
        eager = [plain_generate(reference_runner, p, cfg.max_new_tokens, None) for p in prompts]
    reference_runner.close()
    result = {"variant": args.variant, "dtype": args.dtype, "layers": args.layers,
              "prompts": args.prompts,
              "max_new_tokens": args.max_new_tokens, "torch": torch.__version__,
              "eager_reference_s": round(time.perf_counter() - started, 2), "phases": []}
    records.take()

    patch(args.variant, args.force)
    engine = EmbeddedSpeculativeEngine(target, drafter, num_steps=3, cache="static")

    def phase(name: str, run):
        before = copy.deepcopy({k: dict(v) for k, v in torch._dynamo.utils.counters.items()})
        seen = len(torch._dynamo.utils.get_compilation_metrics())
        began = time.perf_counter()
        value = run()
        seconds = time.perf_counter() - began
        compiles = compiles_since(seen)
        after = {k: dict(v) for k, v in torch._dynamo.utils.counters.items()}
        lines = records.take()
        entry = {"phase": name, "seconds": round(seconds, 2),
                 "frame_compiles": len(compiles),
                 "compile_s": round(sum(c["seconds"] or 0 for c in compiles), 2),
                 "counters": counter_diff(before, after), "compiles": compiles,
                 "symbols": [x for x in lines if "create_symbol" in x or "marking" in x],
                 "recompile_logs": [x for x in lines if "Recompiling" in x],
                 "graph_break_logs": [x for x in lines if "raph break" in x],
                 "warnings": [x for x in lines if "create_symbol" not in x
                              and "marking" not in x and "Recompiling" not in x
                              and "raph break" not in x][:20]}
        result["phases"].append(entry)
        print(f"{name}: {seconds:.1f} s, {len(compiles)} frame compiles "
              f"({entry['compile_s']} s)", flush=True)
        return value

    plain = phase("b1 plain", lambda: plain_decoding(engine, prompts, cfg, None))
    result["b1_plain_identical_to_eager"] = sum(
        g.tokens == e.tokens for g, e in zip(plain, eager, strict=True))
    summary, _ = phase("b1 speculative",
                       lambda: measure_embedded(engine, prompts, cfg, None, "random", eager))
    result["b1_speculative_identical_to_eager"] = summary["identical_outputs"]
    # The benchmark's later speed pairs decode every prompt again: nothing left to compile.
    phase("b1 again", lambda: [decode_again(engine, prompts, cfg, None, side)
                               for side in ("speculative", "plain")])
    for size in args.batch_sizes:
        measured = phase(f"batch {size}",
                         lambda s=size: measure_batched(engine, prompts, cfg, None, s,
                                                           [g.tokens for g in eager]))
        result[f"batch_{size}_identical_to_eager"] = {
            k: measured[k] for k in ("identical_outputs", "plain_identical_outputs",
                                     "near_ties", "groups")}
    result["steps_ran"] = engine.steps_ran()
    result["unique_graphs"] = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    for entry in result["phases"]:
        print(f"\n== {entry['phase']}: {entry['seconds']} s, {entry['frame_compiles']} compiles"
              f" ({entry['compile_s']} s)\n  counters {entry['counters']}")
        for c in entry["compiles"]:
            reason = (c["recompile_reason"] or "").replace("\n", " | ")[:300]
            print(f"  {c['id']:>6} {c['fn']:<45} breaks={c['graph_breaks']} ops={c['ops']} "
                  f"{c['seconds'] and round(c['seconds'], 1)}s fail={c['fail']} {reason}")
        for s in entry["symbols"]:
            print("  sym:", s[:250])
    print(json.dumps({k: v for k, v in result.items() if k != "phases"}, indent=1))


if __name__ == "__main__":
    main()
