"""Drafter training throughput on one GPU with synthetic hidden states (issue 10's benchmark).

Llama-3.1-8B-shaped drafter: hidden 4096, 32 heads, 8 KV heads, intermediate 14336, target
vocab 128256, draft vocab 32000; one packed row of --tokens tokens (documents of --doc tokens),
TTT --steps, AdamW, bf16 autocast with fp32 master weights.

FLOPs counted: 2 per multiply-add of every matmul the step runs (fc once; q/k/v/o, MLP and
lm_head per TTT step; attention scores and values over the dense (j+1)*T keys of step j; the
frozen target head for the targets), times 3 for the trainable parts (forward + backward) and
1 for the target head (no grad). MFU is against 790 TFLOP/s (bf16 matmul measured on an H200).

    python benchmarks/train_throughput.py --tokens 8192 --steps 3
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from draftsmith.model.eagle3 import Eagle3Config, Eagle3Drafter
from draftsmith.train.packing import PackedRow
from draftsmith.train.trainer import row_loss

PEAK_FLOPS = 790e12


def flops_per_row(cfg: Eagle3Config, tokens: int, steps: int) -> float:
    H, I, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim  # noqa: E741
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    per_token_step = 2 * (2 * H * (q + 2 * kv) + q * H + 3 * H * I + H * cfg.draft_vocab_size)
    trainable = 2 * tokens * 3 * H * cfg.target_hidden_size  # fc
    for j in range(steps):
        trainable += tokens * per_token_step
        trainable += 2 * 2 * tokens * (j + 1) * tokens * q  # scores and values, dense
    target_head = 2 * tokens * cfg.target_hidden_size * cfg.vocab_size
    return 3 * trainable + target_head


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--doc", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--iters", type=int, default=5)
    args = parser.parse_args()
    device = "cuda"
    cfg = Eagle3Config(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                       num_key_value_heads=8, head_dim=128, max_position_embeddings=131072,
                       rope_theta=500000.0, vocab_size=128256, draft_vocab_size=32000,
                       target_hidden_size=4096, aux_layer_ids=[1, 15, 28])
    drafter = Eagle3Drafter(cfg)
    g = torch.Generator().manual_seed(0)
    head = torch.randn(cfg.vocab_size, 4096, generator=g) * 0.02
    d2t = torch.zeros(cfg.draft_vocab_size, dtype=torch.int64)
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    t2d[: cfg.draft_vocab_size] = True
    drafter.load_target_parts(torch.randn(cfg.vocab_size, 4096, generator=g) * 0.02, d2t, t2d,
                              target_head=head)
    drafter.to(device)
    head = head.to(device)
    T = args.tokens
    docs = torch.arange(T) // args.doc
    row = PackedRow(
        input_ids=torch.randint(0, cfg.vocab_size, (T,), generator=g),
        loss_mask=torch.ones(T, dtype=torch.bool),
        aux=torch.randn(T, 3 * 4096, generator=g).bfloat16(),
        final=torch.randn(T, 4096, generator=g).bfloat16(),
        position_ids=torch.arange(T) % args.doc,
        document_ids=docs,
    )
    trainable = [p for p in drafter.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-4)
    torch.cuda.reset_peak_memory_stats()

    def one_step() -> None:
        loss, _ = row_loss(drafter, row, head, args.steps, 0.8, device, autocast_bf16=True)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(2):
        one_step()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(args.iters):
        one_step()
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - started) / args.iters
    flops = flops_per_row(cfg, T, args.steps)
    print(json.dumps({
        "tokens_per_row": T, "ttt_steps": args.steps, "seconds_per_step": round(seconds, 4),
        "tokens_per_s": round(T / seconds), "tflops": round(flops / seconds / 1e12, 1),
        "mfu": round(flops / seconds / PEAK_FLOPS, 3),
        "peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
        "trainable_parameters_m": round(sum(p.numel() for p in trainable) / 1e6, 1),
    }))


if __name__ == "__main__":
    main()
