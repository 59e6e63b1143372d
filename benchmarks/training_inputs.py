"""What a user brings to time the data, extract and train stages at a large target's size
without downloading one: a target of Llama-3.1-8B's shape with random weights, data, and a
pipeline config over them. The timing scripts (`online_vs_offline.py`, `train_stage.py`) then
only call the product (`draftsmith run`, `draftsmith compare --to train`), whose rows carry
each stage's seconds, GPU peak and bytes on disk (draftsmith/stage_cost.py).

- The target: random bf16 weights (float32 on a CPU; `small`: a tiny Llama), saved with a
  byte-level BPE trained on the Python standard library (draftsmith/tiny_target.py), whose
  vocabulary the draft vocabulary is drawn from.
- The data: one chat per standard-library module, its source as the answer, cut by merge to
  `doc` tokens (merge.max_length), kept as written (generate.regenerate: none).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from draftsmith.compare import comparison_path, read_comparison
from draftsmith.tiny_target import stdlib_sources, train_tokenizer

CLI = [sys.executable, "-c", "from draftsmith.cli import app; app()"]


def add_arguments(parser: argparse.ArgumentParser, tokens: int) -> None:
    parser.add_argument("--root", type=Path, required=True)
    parser.add_argument("--tokens", type=int, default=tokens, help="training tokens")
    parser.add_argument("--doc", type=int, default=2048, help="tokens a document")
    parser.add_argument("--batch-tokens", type=int, default=8192)
    parser.add_argument("--validation-docs", type=int, default=4)
    parser.add_argument("--draft-vocab", type=int, default=32000)
    parser.add_argument("--tokenizer-vocab", type=int, default=None,
                        help="default: 32000, or 1000 with --small")
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--small", action="store_true", help="a tiny Llama (checks a script)")
    parser.add_argument("--out", type=Path, help="append the result as a JSON line here")


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


def prepare(args: argparse.Namespace, name: str) -> Path:
    """A fresh root with the target, the data and the config; the config's path."""
    cuda = args.device.startswith("cuda")
    shutil.rmtree(args.root, ignore_errors=True)
    (args.root / "target").mkdir(parents=True)
    vocab = build_target(args.root / "target", args.small, "cuda" if cuda else "cpu",
                         args.tokenizer_vocab or (1000 if args.small else 32000))
    documents = args.tokens // args.doc + args.validation_docs
    write_data(args.root / "data.jsonl", documents)
    dtype = "bfloat16" if cuda else "float32"
    config = {
        "name": name, "run_root": str(args.root / "runs"),
        "target": {"model": str(args.root / "target"), "device": args.device, "dtype": dtype},
        "data": {"sources": [{"name": "stdlib-modules", "path": str(args.root / "data.jsonl"),
                              "format": "openai"}]},
        "generate": {"regenerate": "none"},
        "merge": {"max_length": args.doc, "draft_vocab_size": min(args.draft_vocab, vocab),
                  "validation_fraction": args.validation_docs / documents},
        "extract": {"batch_tokens": 32768 if cuda else 2048, "dtype": dtype},
        "train": {"ttt_steps": 3, "batch_tokens": args.batch_tokens, "lr": 1e-5,
                  "device": args.device, "dtype": dtype, "freeze_lm_head": True,
                  "log_every": args.log_every, "attention": "auto" if cuda else "sdpa"},
    }
    path = args.root / "config.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def compare_to_train(config: Path, variants: list[str]) -> list[dict[str, Any]]:
    """`draftsmith compare CONFIG --to train` over the variants; its rows."""
    subprocess.run([*CLI, "compare", str(config), "--to", "train",
                    *(f"--variant={v}" for v in variants)], check=True)
    settings = yaml.safe_load(config.read_text())
    return read_comparison(comparison_path(settings["run_root"], settings["name"]))["rows"]


def keep(args: argparse.Namespace, result: dict[str, Any]) -> None:
    """Print the result, with the GPU and the command, and append it to --out."""
    gpu = None
    if args.device.startswith("cuda"):
        import torch

        gpu = torch.cuda.get_device_name()
    line = json.dumps({**result, "device": args.device, "gpu": gpu,
                       "command": " ".join(sys.argv)})
    print(line, flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.write(line + "\n")
