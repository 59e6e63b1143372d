"""Hidden-state extraction throughput on one GPU, through the extract stage's own code path
(length-sorted shards, token-budget batches, hooks on the aux layers, async shard writer).

Target: Llama-3.1-8B-shaped (hidden 4096, 32 layers, 32 heads, 8 KV heads, intermediate 14336,
vocab 128256) with random bf16 weights, built directly on the GPU; samples of --min-len to
--max-len random tokens.

FLOPs counted (prefill, forward only): 2 per multiply-add of every decoder matmul (q, k, v, o,
gate, up, down) per real token, plus causal attention 2 * T^2 * q_dim per layer per sample
(scores and values, half of the dense 4 * T^2 * q_dim), plus the lm_head over real tokens,
2 * H * V each (the capture stores the target's argmax token at every position, so training
never needs full-vocab logits). Padding and embeddings are not counted. MFU is against
989.4 TFLOP/s (H200 SXM dense bf16, the data sheet), the denominator the training benchmark
uses; results before 2026-12-01's side-by-side run used 790 (about the measured bf16 GEMM
rate), so their MFU reads 1.25x higher.

Two passes: `compute` (shards computed, not written) and `write` (shards written with fsync,
deleted once receipted so the disk does not fill). The disk's own write speed is measured by
writing --disk-gib GiB of random bytes with fsync in the same directory.

    python benchmarks/extract_throughput.py --out /tmp/xb --write-tokens 1000000
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from draftsmith.extract.batching import plan_shards
from draftsmith.extract.capture import HiddenStateCapture
from draftsmith.extract.stage import ShardComputer
from draftsmith.extract.store import (
    AsyncShardWriter,
    ShardReader,
    free_disk_bytes,
    write_index,
)

PEAK_FLOPS = 989.4e12  # H200 SXM dense bf16 (data sheet), as the training benchmark


def build_target(args):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=args.hidden, num_hidden_layers=args.layers,
                         num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                         intermediate_size=args.intermediate, vocab_size=args.vocab,
                         max_position_embeddings=max(8192, args.max_len), rope_theta=500000.0,
                         attn_implementation="sdpa")
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(DTYPE[args.dtype])
    try:
        with torch.device(args.device):  # weights are allocated and initialised on the GPU
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval(), config


DTYPE = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def flops(config, lengths: list[int]) -> float:
    H, I = config.hidden_size, config.intermediate_size  # noqa: E741
    d = H // config.num_attention_heads
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
    linear = 2 * (H * (q + 2 * kv) + q * H + 3 * H * I) * config.num_hidden_layers
    attention = sum(2 * n * n * q for n in lengths) * config.num_hidden_layers
    lm_head = 2 * H * config.vocab_size
    return (linear + lm_head) * sum(lengths) + attention


def make_rows(n_tokens: int, lo: int, hi: int, vocab: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    rows, total = [], 0
    while total < n_tokens:
        T = int(torch.randint(lo, hi + 1, (1,), generator=g))
        rows.append({"id": f"s{seed}-{len(rows)}",
                     "input_ids": torch.randint(0, vocab, (T,), generator=g).tolist(),
                     "loss_mask": [1] * T})
        total += T
    return rows


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_pass(name, args, config, capture, rows, out: Path | None) -> dict:
    device = torch.device(args.device)
    specs = plan_shards("train", rows, args.shard_tokens)
    by_id = {r["id"]: r for r in rows}
    computer = ShardComputer(capture, device, DTYPE[args.dtype], args.batch_size,
                             args.batch_tokens)
    kept = specs[-1].file

    def drop(record):  # keep the disk from filling: only the last shard stays for the check
        if record["file"] != kept:
            (out / record["file"]).unlink()

    writer = None
    if out is not None:
        writer = AsyncShardWriter(out, max_pending=args.writer_queue,
                                  threads=args.writer_threads, on_written=drop)
    sync(args.device)
    started = time.perf_counter()
    for spec in specs:
        make = computer(spec, by_id)
        if writer is not None:
            writer.submit(spec, make)
        else:
            make()  # waits for the device-to-host copies, as the writer would
    sync(args.device)
    compute_done = time.perf_counter() - started
    records = writer.close() if writer is not None else {}
    seconds = time.perf_counter() - started
    lengths = [len(r["input_ids"]) for r in rows]
    tokens = sum(lengths)
    written = sum(r["bytes"] for r in records.values())
    result = {
        "pass": name, "samples": len(rows), "tokens": tokens, "shards": len(specs),
        "seconds": round(seconds, 2), "compute_seconds": round(compute_done, 2),
        "tokens_per_s": round(tokens / seconds), "tflops": round(flops(config, lengths)
                                                                 / seconds / 1e12, 1),
        "mfu": round(flops(config, lengths) / seconds / PEAK_FLOPS, 4),
        "padding_waste": round(1 - computer.real_tokens / computer.padded_tokens, 4),
    }
    if writer is not None:
        result.update({"bytes_written": written, "bytes_per_token": round(written / tokens, 1),
                       "write_gb_per_s": round(written / seconds / 1e9, 3)})
        write_index(out, {"target_fingerprint": "bench", "aux_layer_ids": capture.aux_layer_ids,
                          "hidden_size": config.hidden_size, "dtype": args.dtype},
                    {"train": [records[kept]]})
    print(json.dumps(result), flush=True)
    return result


def check_readback(out: Path, capture, device: str) -> dict:
    """The kept shard read back through the reader (checksum, dtypes, shapes) equals a fresh
    single-sample capture of one of its samples."""
    reader = ShardReader(out)
    sample_id = reader.ids("train")[0]
    sample = reader.sample(sample_id)
    aux, final = capture(sample.input_ids[None].to(device), None)  # [1, T, K*H], [1, T, H]
    aux_err = (aux[0].float().cpu() - sample.aux.float()).abs().max().item()
    final_err = (final[0].float().cpu() - sample.final.float()).abs().max().item()
    scale = sample.aux.float().abs().max().item()
    argmax = capture.target_argmax(final[0]).cpu()  # [T]
    return {"readback_sample": sample_id, "tokens": len(sample.input_ids),
            "aux_max_abs_diff": aux_err, "final_max_abs_diff": final_err, "aux_scale": scale,
            "target_argmax_agreement": (argmax == sample.target_argmax).float().mean().item()}


def disk_write_speed(directory: Path, gib: float) -> float:
    path = directory / "disk-speed.bin"
    block = os.urandom(64 << 20)
    blocks = max(1, int(gib * 16))
    started = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(blocks):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    seconds = time.perf_counter() - started
    path.unlink()
    return blocks * len(block) / seconds / 1e9


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--intermediate", type=int, default=14336)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--min-len", type=int, default=2048)
    p.add_argument("--max-len", type=int, default=8192)
    p.add_argument("--compute-tokens", type=int, default=300_000)
    p.add_argument("--write-tokens", type=int, default=1_000_000)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--batch-tokens", type=int, default=16384)
    p.add_argument("--compute-batch-tokens", type=int, nargs="*", default=None,
                   help="compute pass once per value (compare token budgets)")
    p.add_argument("--shard-tokens", type=int, default=65536)
    p.add_argument("--writer-queue", type=int, default=2)
    p.add_argument("--writer-threads", type=int, default=4)
    p.add_argument("--disk-gib", type=float, default=4.0)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--out", default="/tmp/extract-bench")
    p.add_argument("--profile", type=Path,
                   help="write a torch.profiler table of a compute pass over about 2 batches")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    model, config = build_target(args)
    sync(args.device)
    print(json.dumps({"build_seconds": round(time.perf_counter() - t0, 1),
                      "params": sum(p.numel() for p in model.parameters()),
                      "free_disk_gib": round(free_disk_bytes(out) / 2**30, 1)}), flush=True)
    L = config.num_hidden_layers
    capture = HiddenStateCapture(model, [1, L // 2 - 1, L - 4])
    results = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}}
    warm = make_rows(args.max_len * 2, args.min_len, args.max_len, args.vocab, seed=99)
    run_pass("warmup", args, config, capture, warm, None)
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        rows = make_rows(2 * args.batch_tokens, args.min_len, args.max_len, args.vocab, seed=98)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            run_pass("profiled", args, config, capture, rows, None)
        args.profile.write_text(prof.key_averages().table(
            sort_by="cuda_time_total", row_limit=40, max_name_column_width=70))
    if args.compute_tokens:
        rows = make_rows(args.compute_tokens, args.min_len, args.max_len, args.vocab, seed=1)
        results["compute"] = []
        for budget in args.compute_batch_tokens or [args.batch_tokens]:
            variant = argparse.Namespace(**{**vars(args), "batch_tokens": budget})
            results["compute"].append({"batch_tokens": budget, **run_pass(
                f"compute batch_tokens={budget}", variant, config, capture, rows, None)})
    if args.write_tokens:
        rows = make_rows(args.write_tokens, args.min_len, args.max_len, args.vocab, seed=2)
        results["write"] = run_pass("write", args, config, capture, rows, out)
        results["readback"] = check_readback(out, capture, args.device)
        print(json.dumps(results["readback"]), flush=True)
    if args.disk_gib:
        results["disk_write_gb_per_s"] = round(disk_write_speed(out, args.disk_gib), 3)
        print(json.dumps({"disk_write_gb_per_s": results["disk_write_gb_per_s"]}), flush=True)
    if args.device.startswith("cuda"):
        results["max_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 1)
        results["gpu"] = torch.cuda.get_device_name()
    report = os.environ.get("OUT")
    if report:
        Path(report, "extract_throughput.json").write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
