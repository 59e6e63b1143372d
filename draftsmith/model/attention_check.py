"""Check that a fast TTT attention path agrees with SDPA over a dense mask, on one packed row of
several documents: flex_attention with a block mask (compiled on CUDA), or a merged path (a
dense causal kernel per document, the diagonals merged in: `cudnn`, `flash`, `reference`).

Run it on a new GPU before trusting the fast path there (`python -m
draftsmith.model.attention_check --device cuda`). flex_attention has no backward pass on a CPU,
so there only the outputs are compared.
"""

from __future__ import annotations

import argparse
import json

import torch

from draftsmith.model.eagle3.model import Eagle3Config, Eagle3Drafter


def small_drafter(seed: int = 0, hidden: int = 256, heads: int = 4, kv_heads: int = 2,
                  vocab: int = 1000, draft_vocab: int = 300) -> Eagle3Drafter:
    torch.manual_seed(seed)
    cfg = Eagle3Config(hidden_size=hidden, intermediate_size=2 * hidden, num_attention_heads=heads,
                       num_key_value_heads=kv_heads, head_dim=hidden // heads,
                       max_position_embeddings=8192, vocab_size=vocab,
                       draft_vocab_size=draft_vocab, target_hidden_size=hidden,
                       aux_layer_ids=[1, 2, 3])
    drafter = Eagle3Drafter(cfg)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[:draft_vocab] = True
    drafter.load_target_parts(torch.randn(vocab, hidden), torch.zeros(draft_vocab,
                              dtype=torch.long), t2d)
    return drafter


def packed_row(drafter: Eagle3Drafter, doc_lengths: list[int], seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    cfg = drafter.config
    T = sum(doc_lengths)
    ids = torch.randint(0, cfg.vocab_size, (1, T), generator=g)  # [1, T]
    aux = torch.randn(1, T, 3 * cfg.target_hidden_size, generator=g)  # [1, T, 3H]
    pos = torch.cat([torch.arange(n) for n in doc_lengths])[None]  # [1, T]
    docs = torch.cat([torch.full((n,), i) for i, n in enumerate(doc_lengths)])[None]  # [1, T]
    return ids, aux, pos, docs


def compare_attention_paths(device: str = "cpu", doc_lengths: list[int] | None = None,
                            steps: int = 3, dtype: torch.dtype = torch.float32,
                            grads: bool = True, compiled_layer: bool = False,
                            path: str = "flex") -> dict:
    """Max absolute differences between the SDPA path and `path`: per-step outputs (the
    drafter's norm output) and, with grads, every parameter's gradient of one scalar loss.
    compiled_layer: run `path` through the torch.compile'd decoder layer, as the trainer
    does on CUDA."""
    doc_lengths = doc_lengths or [300, 17, 500, 200, 7]
    drafter = small_drafter()
    with torch.no_grad():
        for p in drafter.parameters():
            p.data = p.data.to(dtype)
    drafter.to(device)
    ids, aux, pos, docs = (t.to(device) for t in packed_row(drafter, doc_lengths))
    aux = aux.to(dtype)
    g = torch.Generator().manual_seed(2)
    probe = torch.randn(steps, aux.shape[1], drafter.config.hidden_size, generator=g)
    probe = probe.to(device, dtype)  # [S, T, H] a random direction for one scalar loss

    def run(attention: str):
        with torch.set_grad_enabled(grads):
            outs = drafter.forward_ttt_hidden(ids, aux, pos, docs, steps, attention)
            if grads:
                loss = sum((o[0].float() * probe[j].float()).sum() for j, o in enumerate(outs))
                loss.backward()
        grads_ = {n: p.grad.detach().clone() for n, p in drafter.named_parameters()
                  if p.grad is not None}
        drafter.zero_grad(set_to_none=True)
        return [o.detach() for o in outs], grads_

    dense_out, dense_grads = run("sdpa")
    drafter.compile_layer(compiled_layer)
    flex_out, flex_grads = run(path)
    drafter.compile_layer(False)
    result = {
        "path": path, "device": device, "dtype": str(dtype).removeprefix("torch."),
        "steps": steps,
        "compiled_layer": compiled_layer,
        "doc_lengths": doc_lengths,
        "output_max_abs": max(o.abs().max().item() for o in dense_out),
        "output_max_diff": [(a - b).abs().max().item()
                            for a, b in zip(dense_out, flex_out, strict=True)],
    }
    if grads:
        assert dense_grads.keys() == flex_grads.keys()
        result["grad_max_rel_diff"] = {
            n: ((dense_grads[n] - flex_grads[n]).abs().max()
                / dense_grads[n].abs().max().clamp(min=1e-30)).item() for n in dense_grads}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--path", default="flex")
    args = parser.parse_args()
    grads = not args.device.startswith("cpu") or args.path != "flex"
    half_only = args.path in ("cudnn", "flash")  # their kernels refuse float32
    for dtype in (torch.bfloat16,) if half_only else (torch.float32, torch.bfloat16):
        for compiled in (False, True) if grads else (False,):
            print(json.dumps(compare_attention_paths(args.device, steps=args.steps, dtype=dtype,
                                                     grads=grads, compiled_layer=compiled,
                                                     path=args.path)))


if __name__ == "__main__":
    main()
