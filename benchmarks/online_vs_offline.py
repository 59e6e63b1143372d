"""Online training against extract + offline training, end to end (issue 19, item 5).

One Llama-3.1-8B-shaped target with random bf16 weights (saved as a checkpoint the stages load),
merged data of random token documents, then, for each epoch count:
- offline: the extract stage (`run_extract`, the store written to disk), then the train stage
  (`run_train`) on it; the extraction is timed once and counted in every epoch count's total;
- online: the train stage with `train.mode: online` (the target's prefill feeds the rows).
Reported per run: wall seconds, trained tokens per second end to end, peak GPU memory, the
bytes each leaves on disk (the store; the drafter and checkpoints are the same for both).
Compiling is shared through one compile cache, warmed first, so it is in neither figure.

    python benchmarks/online_vs_offline.py --root /tmp/ovo --tokens 131072 --epochs 1 5
    python benchmarks/online_vs_offline.py --root /tmp/ovo-cpu --small --device cpu \\
        --tokens 2048 --doc 256 --batch-tokens 512 --epochs 1 2   # checks the script
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from safetensors.torch import save_file

from draftsmith.artifacts import Descriptor, plan_stage
from draftsmith.config import ExtractConfig, TargetConfig, TrainConfig
from draftsmith.data.merge import VOCAB_FILE


def build_target(root: Path, small: bool, device: str) -> Descriptor:
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = dict(hidden_size=64, num_hidden_layers=8, num_attention_heads=4,
                 num_key_value_heads=2, intermediate_size=128, vocab_size=1000) if small else \
        dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
             num_key_value_heads=8, intermediate_size=14336, vocab_size=128256)
    config = LlamaConfig(**shape, max_position_embeddings=8192, rope_theta=500000.0,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    model.save_pretrained(root / "target")
    del model
    figures = {"family": "llama", "architectures": ["LlamaForCausalLM"], "model_type": "llama",
               "num_layers": shape["num_hidden_layers"], "hidden_size": shape["hidden_size"],
               "vocab_size": shape["vocab_size"], "max_position_embeddings": 8192}
    return Descriptor(stage="target", path=str(root / "target"), key="target",
                      fingerprint="synthetic-target", figures=figures)


def write_merged(root: Path, target: Descriptor, tokens: int, doc: int, draft_vocab: int,
                 validation_docs: int) -> Descriptor:
    """What the merge stage hands on: train/validation parquet files and the vocab map."""
    V = target.figures["vocab_size"]
    D = min(draft_vocab, V)
    g = torch.Generator().manual_seed(1)
    out = root / "merge"
    out.mkdir(parents=True, exist_ok=True)
    counts = {}
    for split, docs in (("train", tokens // doc), ("validation", validation_docs)):
        ids = torch.randint(0, D, (docs, doc), generator=g)  # mostly draft-vocab tokens
        mask = torch.ones(docs, doc, dtype=torch.uint8)
        mask[:, : doc // 4] = 0  # a prompt, then the answer
        pq.write_table(pa.table({"id": [f"{split}-{i}" for i in range(docs)],
                                 "input_ids": ids.tolist(), "loss_mask": mask.tolist()}),
                       out / f"{split}.parquet")
        counts[f"{split}_tokens"] = docs * doc
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[:D] = True
    save_file({"d2t": torch.zeros(D, dtype=torch.int64), "t2d": t2d}, str(out / VOCAB_FILE))
    return Descriptor(stage="merge", path=str(out), key="merge", fingerprint="synthetic-merge",
                      counts=counts, figures={"draft_vocab_coverage": 1.0,
                                              "draft_vocab_size": D})


def peak_gib(device: str) -> float | None:
    return round(torch.cuda.max_memory_allocated() / 2**30, 2) if device == "cuda" else None


def reset_peak(device: str) -> None:
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", type=Path, required=True)
    parser.add_argument("--tokens", type=int, default=131072)
    parser.add_argument("--doc", type=int, default=2048)
    parser.add_argument("--batch-tokens", type=int, default=8192)
    parser.add_argument("--validation-docs", type=int, default=4)
    parser.add_argument("--draft-vocab", type=int, default=32000)
    parser.add_argument("--epochs", type=int, nargs="+", default=[1, 5])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--out", type=Path, help="append the result as a JSON line here")
    args = parser.parse_args()
    from draftsmith.extract.stage import record_online_capture, run_extract
    from draftsmith.train.trainer import OnlineInputs, run_train

    shutil.rmtree(args.root, ignore_errors=True)
    args.root.mkdir(parents=True)
    cuda = args.device.startswith("cuda")
    target = build_target(args.root, args.small, "cuda" if cuda else "cpu")
    merged = write_merged(args.root, target, args.tokens, args.doc, args.draft_vocab,
                          args.validation_docs)
    target_cfg = TargetConfig(model=target.path, device=args.device,
                              dtype="bfloat16" if cuda else "float32")
    extract_cfg = ExtractConfig(batch_tokens=32768 if cuda else 2048,
                                dtype="bfloat16" if cuda else "float32")
    cache = args.root / "compile_cache"

    def train_cfg(mode: str, epochs: int) -> TrainConfig:
        return TrainConfig(ttt_steps=3, batch_tokens=args.batch_tokens, epochs=epochs, lr=1e-5,
                           device=args.device, dtype="bfloat16" if cuda else "float32",
                           freeze_lm_head=True, log_every=10, mode=mode,
                           compile_cache=str(cache), attention="auto" if cuda else "sdpa")

    def timed_train(name: str, cfg: TrainConfig, hidden: Descriptor,
                    online: OnlineInputs | None) -> dict:
        reset_peak(args.device)
        started = time.monotonic()
        plan = plan_stage(args.root / name, "train", cfg, [hidden])
        run_train(cfg, hidden, merged, target, plan, online)
        return {"train_s": round(time.monotonic() - started, 1),
                "train_peak_gib": peak_gib(args.device)}

    result: dict = {"tokens": args.tokens, "doc": args.doc, "device": args.device,
                    "gpu": torch.cuda.get_device_name() if cuda else None, "runs": []}
    # Warm the compile cache (one short offline-shaped run), so compiling is in no figure.
    reset_peak(args.device)
    started = time.monotonic()
    store = run_extract(extract_cfg, target_cfg, merged, target,
                        plan_stage(args.root / "offline", "extract", {"k": 1}, [merged]))
    extract = {"extract_s": round(time.monotonic() - started, 1),
               "extract_peak_gib": peak_gib(args.device),
               "store_bytes": dir_bytes(Path(store.path))}
    result["extract"] = extract
    print(json.dumps({"extract": extract}), flush=True)
    timed_train("warm", train_cfg("offline", 1).model_copy(update={"max_steps": 2}), store, None)
    online_hidden = record_online_capture(
        extract_cfg, merged, target, plan_stage(args.root / "online", "extract", {"k": 2},
                                                [merged]))
    online_inputs = OnlineInputs(extract_cfg, target_cfg)
    trained = args.tokens
    for epochs in args.epochs:
        offline = timed_train(f"offline-{epochs}", train_cfg("offline", epochs), store, None)
        total = extract["extract_s"] + offline["train_s"]
        run = {"epochs": epochs, "offline": {
            **offline, "end_to_end_s": round(total, 1),
            "trained_tokens_per_s": round(epochs * trained / total),
            "disk_bytes": extract["store_bytes"],
            "peak_gib": max(filter(None, [offline["train_peak_gib"],
                                          extract["extract_peak_gib"]]), default=None)}}
        online = timed_train(f"online-{epochs}", train_cfg("online", epochs), online_hidden,
                             online_inputs)
        run["online"] = {**online, "end_to_end_s": online["train_s"],
                         "trained_tokens_per_s": round(epochs * trained / online["train_s"]),
                         "disk_bytes": 0, "peak_gib": online["train_peak_gib"]}
        result["runs"].append(run)
        print(json.dumps(run), flush=True)
    line = json.dumps(result)
    print(line, flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    main()
