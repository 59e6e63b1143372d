"""Online training against extract + offline training, end to end (issue 19, item 5), as the
product compares them: `draftsmith compare --to train`, one variant per mode and epoch count,
each row with its stages' seconds, the GPU peak and the bytes its outputs hold on disk
(draftsmith/stage_cost.py). Offline variants share one extraction (Cached after the first),
whose seconds count in each of their end-to-end figures.

What this script adds is only what a user would bring: a target and data.
- The target: Llama-3.1-8B's shape with random bf16 weights (--small: a tiny Llama), saved
  with a byte-level BPE trained on the Python standard library (draftsmith/tiny_target.py),
  whose vocabulary the draft vocabulary is drawn from.
- The data: one chat per standard-library module, its source as the answer, truncated by merge
  to --doc tokens (merge.max_length), kept as written (generate.regenerate: none).
A first variant trains 2 steps, so the compile cache is warm and no figure holds compiling.

    python benchmarks/online_vs_offline.py --root /tmp/ovo --tokens 131072 --epochs 1 5 \\
        --out benchmarks/results/online_vs_offline_h200.jsonl          # on a GPU host
    python benchmarks/online_vs_offline.py --root /tmp/ovo-cpu --small --device cpu \\
        --tokens 4096 --doc 256 --batch-tokens 512 --epochs 1 2      # checks the script
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from draftsmith.compare import read_comparison
from draftsmith.tiny_target import stdlib_sources, train_tokenizer

NAME = "online-vs-offline"


def build_target(out: Path, small: bool, device: str, tokenizer_vocab: int) -> int:
    """The target's checkpoint and tokenizer in `out`; its vocabulary size."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = dict(hidden_size=64, num_hidden_layers=8, num_attention_heads=4,
                 num_key_value_heads=2, intermediate_size=128) if small else \
        dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
             num_key_value_heads=8, intermediate_size=14336, vocab_size=128256)
    tokenizer = train_tokenizer(out, tokenizer_vocab)
    config = LlamaConfig(**{"vocab_size": len(tokenizer), **shape},
                         max_position_embeddings=8192, rope_theta=500000.0,
                         tie_word_embeddings=False, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(torch.float32 if device == "cpu"
                                            else torch.bfloat16)
    model.save_pretrained(out)
    return config.vocab_size


def write_data(path: Path, records: int) -> None:
    """One chat per standard-library module (its source as the answer), longest first."""
    sources = sorted(stdlib_sources(), key=lambda p: p.stat().st_size, reverse=True)
    if len(sources) < records:
        raise SystemExit(f"--tokens/--doc ask for {records} documents; the standard library "
                         f"has {len(sources)} modules: raise --doc or lower --tokens")
    with open(path, "w") as f:
        for source in sources[:records]:
            f.write(json.dumps({"messages": [
                {"role": "user", "content": f"Show me the source of {source.stem}."},
                {"role": "assistant", "content": source.read_text(errors="replace")}]}) + "\n")


def write_config(root: Path, args: argparse.Namespace, cuda: bool, vocab: int) -> Path:
    dtype = "bfloat16" if cuda else "float32"
    documents = args.tokens // args.doc + args.validation_docs
    config = {
        "name": NAME, "run_root": str(root / "runs"),
        "target": {"model": str(root / "target"), "device": args.device, "dtype": dtype},
        "data": {"sources": [{"name": "stdlib-modules", "path": str(root / "data.jsonl"),
                              "format": "openai"}]},
        "generate": {"regenerate": "none"},
        "merge": {"max_length": args.doc, "draft_vocab_size": min(args.draft_vocab, vocab),
                  "validation_fraction": args.validation_docs / documents},
        "extract": {"batch_tokens": 32768 if cuda else 2048, "dtype": dtype},
        "train": {"ttt_steps": 3, "batch_tokens": args.batch_tokens, "lr": 1e-5,
                  "device": args.device, "dtype": dtype, "freeze_lm_head": True,
                  "log_every": 10, "attention": "auto" if cuda else "sdpa"},
    }
    path = root / "config.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, required=True)
    parser.add_argument("--tokens", type=int, default=131072)
    parser.add_argument("--doc", type=int, default=2048)
    parser.add_argument("--batch-tokens", type=int, default=8192)
    parser.add_argument("--validation-docs", type=int, default=4)
    parser.add_argument("--draft-vocab", type=int, default=32000)
    parser.add_argument("--tokenizer-vocab", type=int, default=None,
                        help="default: 32000, or 1000 with --small")
    parser.add_argument("--epochs", type=int, nargs="+", default=[1, 5])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--out", type=Path, help="append the result as a JSON line here")
    args = parser.parse_args()
    cuda = args.device.startswith("cuda")
    shutil.rmtree(args.root, ignore_errors=True)
    (args.root / "target").mkdir(parents=True)
    vocab = build_target(args.root / "target", args.small, "cuda" if cuda else "cpu",
                         args.tokenizer_vocab or (1000 if args.small else 32000))
    write_data(args.root / "data.jsonl", args.tokens // args.doc + args.validation_docs)
    config = write_config(args.root, args, cuda, vocab)
    variants = ["warm: train.mode=offline train.epochs=1 train.max_steps=2"]
    for epochs in args.epochs:
        variants += [f"offline-{epochs}: train.mode=offline train.epochs={epochs}",
                     f"online-{epochs}: train.mode=online train.epochs={epochs}"]
    command = [sys.executable, "-c", "from draftsmith.cli import app; app()", "compare",
               str(config), "--to", "train", *(f"--variant={v}" for v in variants)]
    subprocess.run(command, check=True)
    rows = read_comparison(args.root / "runs" / "compare" / f"{NAME}.json")["rows"]
    gpu = None
    if cuda:
        import torch

        gpu = torch.cuda.get_device_name()
    result = {"tokens": args.tokens, "doc": args.doc, "device": args.device, "gpu": gpu,
              "command": " ".join(sys.argv), "rows": rows}
    line = json.dumps(result)
    print(line, flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    main()
