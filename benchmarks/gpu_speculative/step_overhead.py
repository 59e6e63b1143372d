"""Is the embedded engine's 4.1 ms plain step on a GPU the GPU's work or the host's (issue 46)?
One target step of the static path (the StaticCache and the aux-layer hooks the engine keeps),
at widths 1 (a plain step) and 4 (a verify of 3 drafts), timed these ways:

- eager: the forward with its kernels launched one by one from Python;
- reduce-overhead: torch.compile mode "reduce-overhead" (CUDA graph trees, outputs copied
  out), the product's step until 2026-12-06, what the benchmark stage measured before;
- product: StaticTargetRunner's step now (draftsmith.compiling.CapturedStep: the compiled
  forward captured into one CUDA graph per width and replayed);
- captured: the same by this script's own hand, the forward compiled without CUDA graphs,
  captured once into one torch.cuda.CUDAGraph over fixed input buffers and replayed, as vLLM
  and SGLang run a step (the host's part is one copy and one replay); captured-eager: the
  eager forward captured so;
- gpu_ms: a captured graph's own GPU time (CUDA events around replays, no host wait between).

Each way decodes --tokens greedy tokens from one prompt, one step at a time; its tokens must
equal eager's (float32), or its row says where they part. One JSON line per way and width:

    python benchmarks/gpu_speculative/step_overhead.py \\
        --out benchmarks/results/gpu_speculative/step_overhead.jsonl
    # here, a check of the script (eager only)
    python benchmarks/gpu_speculative/step_overhead.py --device cpu --tokens 8 --out /tmp/so.jsonl

--random-weights times SmolLM2's shapes with random weights (random_parts.py): no GGUF to
carry to the GPU, the same costs, and tokens that still must equal eager's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from draftsmith.config import TargetConfig  # noqa: E402
from draftsmith.serve.embedded import StaticTargetRunner  # noqa: E402
from draftsmith.target import load_target_model, load_tokenizer, resolve_target  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from random_parts import smollm2_shaped_target  # noqa: E402

AUX_LAYER_IDS = [1, 14, 26]  # SmolLM2-135M's 30 layers: 1, L//2 - 1, L - 4


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def decode(step: Callable[[torch.Tensor], torch.Tensor], first: int, width: int,
           tokens: int, device: str) -> tuple[list[int], list[float]]:
    """Greedy tokens from `first`, one step a token; a step of `width` feeds the last token
    and width - 1 copies of it (a verify's shape; only the first row's argmax is taken), and
    the cache is wound back to keep one position. Returns the tokens and each step's wall ms."""
    out, times, last = [], [], first
    for _ in range(tokens):
        ids = torch.full((1, width), last, device=device)  # [1, W]
        sync(device)
        began = time.perf_counter()
        logits = step(ids)  # [W, V]
        last = int(logits[0].argmax())
        times.append(1000 * (time.perf_counter() - began))
        out.append(last)
    return out, times


def figures(way: str, width: int, tokens: list[int], times: list[float],
            reference: list[int] | None, extra: dict | None = None) -> dict:
    part = next((i for i, (a, b) in enumerate(zip(tokens, reference or tokens, strict=True))
                 if a != b), None)
    kept = times[len(times) // 4:]  # the first quarter warms caches and allocators
    return {"way": way, "width": width, "steps": len(kept),
            "ms_median": round(statistics.median(kept), 3),
            "ms_p10": round(sorted(kept)[len(kept) // 10], 3),
            "ms_p90": round(sorted(kept)[9 * len(kept) // 10], 3),
            "identical_to_eager": part is None, "first_difference": part, **(extra or {})}


class Stepper:
    """A runner's forward as one step of `width` tokens over its static cache, kept at one
    generation: after each step all but the first new position are dropped."""

    def __init__(self, runner: StaticTargetRunner, prompt: list[int], width: int,
                 capacity: int):
        self.runner, self.width = runner, width
        self.cache = runner.new_cache(capacity)
        logits, _ = runner.forward(prompt, self.cache)  # the prompt, eagerly: [T, V]
        self.first = int(logits[-1].argmax())

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        logits, _ = self.runner.forward(ids[0].tolist(), self.cache)  # [W, V]
        if self.width > 1:
            self.runner.drop_last(self.cache, self.width - 1)
        return logits


class HandCaptured:
    """The forward over the runner's StaticCache captured into one CUDA graph: input ids are
    copied into a fixed buffer, the graph replayed, the logits read from its fixed output. The
    cache's counters are device tensors advanced inside the graph, so winding back rejected
    positions stays the runner's `drop_last`."""

    def __init__(self, stepper: Stepper, compiled: bool):
        runner, width = stepper.runner, stepper.width
        model, self.stepper = runner.model, stepper
        forward = torch.compile(model.forward) if compiled else model.forward
        self.ids = torch.zeros(1, width, dtype=torch.long, device=model.device)  # [1, W]
        kv = stepper.cache.kv

        def step() -> tuple[torch.Tensor, torch.Tensor]:
            logits = forward(input_ids=self.ids, use_cache=True,
                             **{runner._cache_kw: kv}).logits  # [1, W, V]
            return logits[0], runner._aux.take()  # [W, V], [1, W, K*H]

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):  # compile and warm up, then take the positions back
                step()
                runner.drop_last(stepper.cache, width)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits, self.aux = step()  # recorded, not run: the counters stay

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        self.ids.copy_(ids)
        self.graph.replay()
        if self.stepper.width > 1:
            self.stepper.runner.drop_last(self.stepper.cache, self.stepper.width - 1)
        return self.logits

    def gpu_ms(self, replays: int = 50) -> float:
        """GPU time of one replay: events around `replays` back to back."""
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        # Each replay keeps one position more: make room for them in the cache first.
        self.stepper.runner.drop_last(self.stepper.cache, replays)
        start.record()
        for _ in range(replays):
            self.graph.replay()
            if self.stepper.width > 1:
                self.stepper.runner.drop_last(self.stepper.cache, self.stepper.width - 1)
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / replays


def reduce_overhead(runner: StaticTargetRunner) -> StaticTargetRunner:
    """The runner with its 1-token and verify steps through torch.compile's "reduce-overhead"
    mode, each call a CUDA-graph-trees generation of its own with its outputs copied out."""
    compiled = torch.compile(runner.model.forward, mode="reduce-overhead")

    def step(ids: torch.Tensor, cache, **extra):
        torch.compiler.cudagraph_mark_step_begin()
        logits = compiled(input_ids=ids, use_cache=True, **{runner._cache_kw: cache},
                          **extra).logits.clone()  # [B, T, V]
        return logits, runner._aux.take()  # [B, T, V], [B, T, K*H]

    runner.step_for = lambda width: step
    return runner


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--widths", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--ways", nargs="+", help="only these ways (eager always runs)")
    parser.add_argument("--random-weights", action="store_true",
                        help="SmolLM2's shapes with random weights (no GGUF needed)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.random_weights:
        model = smollm2_shaped_target(args.device)
        prompt = list(range(1000, 1040))  # a prompt's length; its ids matter not
    else:
        target = resolve_target(TargetConfig(model="builtin:smollm2-135m-instruct",
                                             dtype="float32"))
        tokenizer = load_tokenizer(target)
        prompt = list(tokenizer.apply_chat_template(
            [{"role": "user", "content": "Explain how a hash map works."}],
            add_generation_prompt=True, tokenize=True, return_dict=False))
        model = load_target_model(target.path, args.device, "float32")
    capacity = len(prompt) + args.tokens + max(args.widths) + 8
    on_gpu = args.device == "cuda"
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def ways(width: int):
        yield "eager", StaticTargetRunner(model, AUX_LAYER_IDS, (1, width), compile_steps=False)
        if on_gpu:
            yield "reduce-overhead", reduce_overhead(
                StaticTargetRunner(model, AUX_LAYER_IDS, (1, width), compile_steps=False))
            yield "product", StaticTargetRunner(model, AUX_LAYER_IDS, (1, width))
            yield "captured", StaticTargetRunner(model, AUX_LAYER_IDS, (1, width),
                                                 compile_steps=False)
            yield "captured-eager", StaticTargetRunner(model, AUX_LAYER_IDS, (1, width),
                                                       compile_steps=False)

    for width in args.widths:
        reference = None
        for way, runner in ways(width):
            if args.ways and way != "eager" and way not in args.ways:
                runner.close()
                continue
            stepper = Stepper(runner, prompt, width, capacity)
            first, extra = stepper.first, {}
            try:
                step = (HandCaptured(stepper, compiled=way == "captured")
                        if way.startswith("captured") else stepper)
                if way in ("reduce-overhead", "product"):  # compile and capture, untimed
                    decode(step, first, width, 3, args.device)
                    runner.drop_last(stepper.cache, 3)
                tokens, times = decode(step, first, width, args.tokens, args.device)
                if way.startswith("captured"):
                    extra["gpu_ms"] = round(step.gpu_ms(), 3)
            except Exception as err:  # noqa: BLE001 - a way this torch cannot run is a finding
                row = {"way": way, "width": width,
                       "error": f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"}
            else:
                row = figures(way, width, tokens, times, reference, extra)
                reference = reference or tokens
            finally:
                runner.close()
            row["device"] = torch.cuda.get_device_name() if on_gpu else "cpu"
            row["weights"] = "random" if args.random_weights else "smollm2"
            print(json.dumps(row), flush=True)
            with open(args.out, "a") as f:  # row by row: a run cut short keeps its rows
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
