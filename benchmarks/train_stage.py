"""The real train stage (`run_train`, what `draftsmith train` and the flow's task call) on an
on-disk hidden-state store of a Llama-3.1-8B-shaped target, against the in-memory loop of
benchmarks/train_throughput.py (issue 18, item 3), and the compile cache cold vs warm (item 4).

The store is synthetic (random hidden states, documents of --doc tokens, the target's argmax
stored) but written through the extract stage's own writer (`AsyncShardWriter`, receipts,
`write_index`) and read back by the trainer through `ShardReader` (checksums verified), so the
stage pays for everything a real run pays for: store checks, row building from memory maps on
the prefetch thread, host-to-device copies, metrics, the epoch-end checkpoint.

Figures: steady tokens/s from the stage's own metrics lines after step 1 (compiling falls in
step 1's line and is reported as first_step_s), the stage's wall time and its parts. --runs 2
trains twice in fresh run roots sharing one compile cache: the second run's first step is the
warm-cache figure.

    python benchmarks/train_stage.py --root /tmp/stage --tokens 262144 --runs 2
    python benchmarks/train_stage.py --root /tmp/stage-cpu --small --device cpu --tokens 2048 \
        --doc 256 --batch-tokens 512   # checks the script
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from draftsmith.artifacts import Descriptor, plan_stage
from draftsmith.config import TrainConfig
from draftsmith.data.merge import VOCAB_FILE
from draftsmith.extract.store import AsyncShardWriter, ShardSpec, write_index


def target_config(small: bool) -> dict:
    if small:
        return {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
                "num_key_value_heads": 2, "head_dim": 16, "num_hidden_layers": 8,
                "vocab_size": 1000, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
                "rope_theta": 10000.0}
    return {"hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128, "num_hidden_layers": 32,
            "vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
            "rope_theta": 500000.0}


def write_inputs(root: Path, args) -> tuple[Descriptor, Descriptor, Descriptor, dict]:
    """A target (config, embedding, head), a merged dir (the vocab map) and the store."""
    cfg = target_config(args.small)
    H, V = cfg["hidden_size"], cfg["vocab_size"]
    D = min(args.draft_vocab, V)
    g = torch.Generator().manual_seed(0)
    target = root / "target"
    target.mkdir(parents=True, exist_ok=True)
    (target / "config.json").write_text(json.dumps({"model_type": "llama", **cfg}))
    save_file({"model.embed_tokens.weight": (torch.randn(V, H, generator=g) * 0.02).bfloat16(),
               "lm_head.weight": torch.randn(V, H, generator=g).bfloat16()},
              str(target / "model.safetensors"))
    merged = root / "merge"
    merged.mkdir(exist_ok=True)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[:D] = True
    save_file({"d2t": torch.zeros(D, dtype=torch.int64), "t2d": t2d}, str(merged / VOCAB_FILE))

    store = root / "store"
    started = time.monotonic()
    aux_ids = [1, cfg["num_hidden_layers"] // 2 - 1, cfg["num_hidden_layers"] - 4]
    writer = AsyncShardWriter(store, max_pending=2, threads=2)
    splits: dict[str, list[ShardSpec]] = {"train": [], "validation": []}
    n_docs = args.tokens // args.doc
    per_shard = max(1, args.shard_tokens // args.doc)
    for split, docs in (("train", n_docs), ("validation", args.validation_docs)):
        for index, first in enumerate(range(0, docs, per_shard)):
            ids = [f"{split}-{i}" for i in range(first, min(docs, first + per_shard))]
            spec = ShardSpec(split, index, tuple(ids), tuple(args.doc for _ in ids))
            T = spec.num_tokens
            argmax = torch.where(torch.rand(T, generator=g) < 0.9,
                                 torch.randint(0, D, (T,), generator=g),
                                 torch.randint(D, V, (T,), generator=g)).to(torch.int32)
            tensors = {
                "input_ids": torch.randint(0, V, (T,), generator=g),  # [T]
                "loss_mask": torch.ones(T, dtype=torch.uint8),  # [T]
                "aux": torch.randn(T, 3 * H, generator=g).bfloat16(),  # [T, 3H]
                "final": torch.randn(T, H, generator=g).bfloat16(),  # [T, H]
                "target_argmax": argmax,  # [T]
                "offsets": torch.arange(0, T + 1, args.doc),  # [n+1]
            }
            writer.submit(spec, lambda t=tensors: t)
            splits[split].append(spec)
    records = writer.close()
    write_index(store, {"target_fingerprint": "synthetic", "aux_layer_ids": aux_ids,
                        "hidden_size": H, "dtype": "bfloat16", "backend": "transformers"},
                {s: [records[spec.file] for spec in specs] for s, specs in splits.items()})
    written = sum(r["bytes"] for r in records.values())
    figures = {"store_bytes": written, "store_gib": round(written / 2**30, 2),
               "store_write_s": round(time.monotonic() - started, 1),
               "train_tokens": n_docs * args.doc}

    def desc(stage: str, path: Path) -> Descriptor:
        return Descriptor(stage=stage, path=str(path), key=stage, fingerprint=f"synthetic-{stage}")

    return desc("extract", store), desc("merge", merged), desc("target", target), figures


def run_once(args, run_root: Path, hidden, merged, target) -> dict:
    from draftsmith.train.trainer import METRICS_FILE, run_train

    cfg = TrainConfig(
        ttt_steps=args.ttt, batch_tokens=args.batch_tokens, epochs=args.epochs, lr=1e-5,
        warmup_ratio=0.0, scheduler="constant", device=args.device,
        dtype="bfloat16" if args.device.startswith("cuda") else "float32",
        log_every=args.log_every, freeze_lm_head=args.lm_head == "frozen",
        compile=not args.no_compile, compile_cache=str(args.compile_cache),
        attention="auto" if args.device.startswith("cuda") else "sdpa")
    plan = plan_stage(run_root, "train", cfg, [hidden])
    if args.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    started = time.monotonic()
    descriptor = run_train(cfg, hidden, merged, target, plan)
    wall = time.monotonic() - started
    lines = [json.loads(x) for x in (Path(descriptor.path) / METRICS_FILE).read_text().splitlines()]
    train = [h for h in lines if h["split"] == "train"]
    steps = train[-1]["step"]
    # Each line's tokens/s is over its window (the steps since the line before). Step 1's
    # line holds the compile; the next window can still hold a late compile (seen on the
    # H200: step 2 compiled again on a cold cache), so the steady figure starts after it.
    windows = [(b["step"] - a["step"], b["tokens_per_s"])
               for a, b in zip(train[:-1], train[1:], strict=True)]
    steady = windows[1:]
    tokens = sum(n * args.batch_tokens for n, _ in steady)
    seconds = sum(n * args.batch_tokens / tps for n, tps in steady)
    return {
        "steps": steps, "wall_s": round(wall, 1),
        "first_step_s": round(args.batch_tokens / train[0]["tokens_per_s"], 1),
        "steady_tokens_per_s": round(tokens / seconds) if seconds else None,
        "window_tokens_per_s": [round(t) for _, t in windows],
        "second_window_s": round(windows[0][0] * args.batch_tokens / windows[0][1], 1)
        if windows else None,
        "peak_memory_gib": round(train[-1]["gpu_memory_gib"], 2),
        "steady_steps": sum(n for n, _ in steady),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", type=Path, required=True)
    parser.add_argument("--tokens", type=int, default=262144, help="training tokens in the store")
    parser.add_argument("--doc", type=int, default=2048)
    parser.add_argument("--batch-tokens", type=int, default=8192)
    parser.add_argument("--shard-tokens", type=int, default=1 << 16)
    parser.add_argument("--validation-docs", type=int, default=4)
    parser.add_argument("--draft-vocab", type=int, default=32000)
    parser.add_argument("--ttt", type=int, default=3)
    parser.add_argument("--lm-head", default="frozen", choices=["frozen", "trainable"])
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--log-every", type=int, default=8)
    parser.add_argument("--runs", type=int, default=2, help="2: cold, then warm compile cache")
    parser.add_argument("--compile-cache", type=Path, help="default: ROOT/compile_cache")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--out", type=Path, help="append the result as a JSON line here")
    parser.add_argument("--train-run", type=int, help=argparse.SUPPRESS)  # the child's part
    args = parser.parse_args()
    args.compile_cache = args.compile_cache or args.root / "compile_cache"
    inputs_file = args.root / "inputs.json"
    if args.train_run is not None:  # one run of the stage, in a process of its own
        inputs = {k: Descriptor.model_validate(v)
                  for k, v in json.loads(inputs_file.read_text()).items()}
        outcome = run_once(args, args.root / f"run{args.train_run}", inputs["hidden"],
                           inputs["merged"], inputs["target"])
        print("RUN " + json.dumps(outcome), flush=True)
        return
    shutil.rmtree(args.root, ignore_errors=True)
    args.root.mkdir(parents=True)
    hidden, merged, target, figures = write_inputs(args.root, args)
    inputs_file.write_text(json.dumps({"hidden": hidden.model_dump(), "merged": merged.model_dump(),
                                       "target": target.model_dump()}))
    print(json.dumps({"store": figures}), flush=True)
    result = {"stage": "train", "doc_tokens": args.doc, "tokens_per_row": args.batch_tokens,
              "ttt_steps": args.ttt, "lm_head": args.lm_head, **figures, "runs": []}
    for run in range(args.runs):  # a fresh process each: what a retry or a rerun is
        started = time.monotonic()
        child = subprocess.run([sys.executable, *sys.argv, "--train-run", str(run)],
                               capture_output=True, text=True)
        lines = [x for x in child.stdout.splitlines() if x.startswith("RUN ")]
        if child.returncode != 0 or not lines:
            print(child.stdout[-3000:], child.stderr[-5000:], flush=True)
            result["runs"].append({"error": f"exit {child.returncode}",
                                   "stderr_tail": child.stderr[-1500:]})
            continue
        outcome = json.loads(lines[-1][4:])
        outcome["process_s"] = round(time.monotonic() - started, 1)
        outcome["compile_cache"] = "cold" if run == 0 else "warm"
        result["runs"].append(outcome)
        print(json.dumps(outcome), flush=True)
    line = json.dumps(result)
    print(line, flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    main()
