"""Decode attention alone, at the generate stage's shapes: is the kernel the stage uses the
fastest way to read a padded cache? (Issue 27: cuDNN's SDPA kernel took 627 us a call for 2,048
rows over a 768-token cache, about 40% of the bandwidth bound.)

One decode step of one layer, SmolLM2's heads (9 query heads on 3 KV heads, dim 64), a
left-padded mask, bf16. Each variant prints one JSON line: microseconds a call (CUDA events
over --iters calls), the keys' and values' bytes over that time, and its largest difference
from `grouped_sdpa` (`grouped_decode_attention`, the SDPA decode step).

    python benchmarks/decode_attention.py --out decode_attention_h200.jsonl   # one H200 call
    python benchmarks/decode_attention.py --smoke --out /tmp/attention.jsonl   # CPU, small
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from draftsmith.model.grouped_attention import (  # noqa: E402
    grouped_decode_attention,
    grouped_decode_flex,
    grouped_decode_matmul,
)


class Layer:  # what grouped_decode_attention reads off transformers' attention module
    def __init__(self, groups: int):
        self.num_key_value_groups = groups
        self.is_causal = True
        self.training = False


def grouped_sdpa(layer, query, key, value, mask, scale):
    return grouped_decode_attention(layer, query, key, value, mask, scaling=scale)[0]


def repeated_sdpa(layer, query, key, value, mask, scale):
    """transformers' own SDPA path: every KV head repeated for its query heads."""
    groups = layer.num_key_value_groups
    key = key.repeat_interleave(groups, dim=1)  # [B, nh, S, d]
    value = value.repeat_interleave(groups, dim=1)  # [B, nh, S, d]
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale)
    return out.transpose(1, 2)  # [B, 1, nh, d]


def grouped_matmul(layer, query, key, value, mask, scale):
    """Two batched matmuls and a float32 softmax: each KV head read once, no attention kernel
    (the generator's `decode_attention="matmul"`). The 2026-12-03 figures were measured with
    this script's own copy of it (40207e6), which scaled before casting to float32."""
    return grouped_decode_matmul(layer, query, key, value, mask, scaling=scale)[0]


def grouped_flex(layer, query, key, value, mask, scale):
    """torch's flex attention with a block mask (the generator's `decode_attention="flex"`);
    compiled, it is flex decoding's split-KV kernel, skipping blocks no row sees."""
    return grouped_decode_flex(layer, query, key, value, mask, scaling=scale)[0]


VARIANTS = {"grouped_sdpa": grouped_sdpa, "repeated_sdpa": repeated_sdpa,
            "grouped_matmul": grouped_matmul, "grouped_flex": grouped_flex}
# Which variants run eagerly and which compiled: inductor may fuse the matmul form; flex
# attention is only a kernel when compiled; SDPA stays SDPA.
COMPILED = {"grouped_matmul": (False, True), "grouped_flex": (True,)}


def time_call(fn, args, iters: int, device: str) -> float:
    """Microseconds a call."""
    for _ in range(3):
        fn(*args)
    if device == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn(*args)
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) * 1000 / iters
    began = time.perf_counter()
    for _ in range(iters):
        fn(*args)
    return (time.perf_counter() - began) * 1e6 / iters


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--iters", type=int, default=50)
    args = parser.parse_args(argv)
    device = "cpu" if args.smoke else "cuda"
    dtype = torch.float32 if args.smoke else torch.bfloat16
    # (rows, cache length, positions written so far): a full cache with up to half of it
    # left padding (as before), and mid-decode caches, where the stage-wide cache length
    # leaves the end of every row unwritten (masked; flex with a block mask skips it).
    shapes = [(8, 64, 64), (8, 256, 100)] if args.smoke else [
        (2048, 768, 320), (2048, 768, 512), (2048, 768, 768), (2048, 384, 384),
        (4096, 768, 768)]
    nkv, groups, dim = 3, 3, 64
    layer = Layer(groups)
    torch.manual_seed(0)
    for batch, length, written in shapes:
        heads = nkv * groups
        query = torch.randn(batch, heads, 1, dim, device=device, dtype=dtype)  # [B, nh, 1, d]
        key = torch.randn(batch, nkv, length, dim, device=device, dtype=dtype)  # [B, nkv, S, d]
        value = torch.randn_like(key)  # [B, nkv, S, d]
        # Left padding: row r's first pads[r] positions are masked out.
        most_pad = length // 2 if written == length else 32
        pads = torch.randint(0, most_pad, (batch,), device=device)  # [B]
        positions = torch.arange(length, device=device)  # [S]
        seen = (positions[None, :] >= pads[:, None]) & (positions[None, :] < written)  # [B, S]
        mask = torch.where(seen, 0.0, float("-inf"))  # [B, S]
        mask = mask[:, None, None, :].to(dtype)  # [B, 1, 1, S]
        scale = dim ** -0.5
        inputs = (layer, query, key, value, mask, scale)
        reference = grouped_sdpa(*inputs).float()
        kv_bytes = 2 * key.numel() * key.element_size()
        for name, fn in VARIANTS.items():
            for compiled in COMPILED.get(name, (False,)):
                call = torch.compile(fn, dynamic=False) if compiled else fn
                try:
                    out = call(*inputs).float()
                    us = time_call(call, inputs, 3 if args.smoke else args.iters, device)
                except Exception as err:  # noqa: BLE001 - recorded, the others still run
                    row = {"variant": name, "compiled": compiled, "batch": batch,
                           "cache_length": length, "written": written,
                           "error": f"{type(err).__name__}: {err}"[:300]}
                else:
                    row = {"variant": name, "compiled": compiled, "batch": batch,
                           "cache_length": length, "written": written,
                           "us_per_call": round(us, 1),
                           "kv_gb_per_s": round(kv_bytes / us / 1e3, 1),
                           "max_abs_diff": round((out - reference).abs().max().item(), 5),
                           "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                           "torch": torch.__version__}
                print(json.dumps(row), flush=True)
                with open(args.out, "a") as f:
                    f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
