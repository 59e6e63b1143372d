"""What choosing a draft tree costs on a GPU, apart from the drafter's steps (issue 46): on an
H100 a tree round of 3 levels of 4 drafted in 0.654 ms where a chain of 3 took 0.347
(lease_2026-12-07a), and the drafter's steps are the same GEMMs at 1 row or 4. The rest is
the choice: each level's top 4 of the 16,384-word draft vocabulary, the next frontier, the
tree's nodes and who sees whom. Here that choice alone (static_tree's functions, on random
logits of the recipe's shapes) runs compiled and captured in one CUDA graph, as the engine's
round runs it, for each way of taking a row's top k; a chain's argmax of the same logits is
the floor. Each variant is checked against torch.topk and sorts for the same tree.

    python benchmarks/gpu_speculative/tree_choice_cost.py --out costs.jsonl   # on a GPU
    python benchmarks/gpu_speculative/tree_choice_cost.py --device cpu --repeats 3 \\
        --out /tmp/choice.jsonl                                             # a check, here
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from draftsmith.serve import row_topk, static_tree  # noqa: E402

DRAFT_VOCAB = 16384  # the recipe's merge.draft_vocab_size
STEPS, TOPK, NODES = 3, 4, 7  # the tree the sweep measures: 3 levels of 4, 8 verify tokens


def library_topk(logits: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.topk of the log-softmax: what both paths ran before 7deca29."""
    return torch.log_softmax(logits.float(), -1).topk(topk)  # [F, k], [F, k]


def chunked_topk(logits: torch.Tensor, topk: int, chunk: int = 128
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The top k in two small passes: the k chunks of `chunk` ids with the highest maxima
    hold the top k (ordering by value, then the lower id, chunks being runs of ids), then
    topk argmaxes over those k * chunk logits, laid out by id."""
    scores = logits.float()  # [F, D]
    rows, width = scores.shape
    log_total = scores.logsumexp(-1, keepdim=True)  # [F, 1]
    chunks = scores.view(rows, width // chunk, chunk)  # [F, G, c]
    _, best_chunks = row_topk.reference(chunks.amax(-1), topk)  # [F, k]
    best_chunks = best_chunks.sort(-1).values  # [F, k]: in id order
    ids = (best_chunks[..., None] * chunk
           + torch.arange(chunk, device=scores.device)).flatten(1)  # [F, k*c]
    _, picked = row_topk.reference(scores.gather(-1, ids), topk)  # [F, k]
    top = ids.gather(-1, picked)  # [F, k]
    return scores.gather(-1, top) - log_total, top  # [F, k], [F, k]


def logits_topk(logits: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.topk of the logits, the log-softmax taken of the k picked only."""
    scores = logits.float()  # [F, D]
    values, ids = scores.topk(topk)  # [F, k], [F, k]
    return values - scores.logsumexp(-1, keepdim=True), ids  # [F, k], [F, k]


def sorted_row(logits: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A stable sort of the whole row (which the compiler may lower to its own kernel)."""
    scores = logits.float()  # [F, D]
    values, ids = scores.sort(dim=-1, descending=True, stable=True)  # [F, D], [F, D]
    return values[:, :topk] - scores.logsumexp(-1, keepdim=True), ids[:, :topk]  # [F, k]


VARIANTS = {"library topk": library_topk, "argmaxes": row_topk.reference,
            "chunked": chunked_topk, "topk of logits": logits_topk, "sorted row": sorted_row,
            "triton row kernel": row_topk.row_topk}  # the reference where Triton cannot run


def tree_choice(topk_of, root_logits, level_logits, depths):
    """A round's choice as `tree_round_steps` makes it, the drafter's steps left out:
    root_logits [1, D], level_logits [S-1, k, D] -> nodes, parents, depths [N], visible."""
    def children(parent_scores, logits):
        logp, ids = topk_of(logits, TOPK)  # [F, k], [F, k]
        return (parent_scores[:, None] + logp.double()).flatten(), ids.flatten()  # [F*k]

    dev = root_logits.device
    scores, ids = children(torch.zeros(1, dtype=torch.float64, device=dev), root_logits)
    listed, frontier = [(scores, ids, torch.full((TOPK,), -1, device=dev))], torch.arange(
        TOPK, device=dev)  # [k]
    for level in range(1, STEPS):
        count = sum(len(c[0]) for c in listed)
        scores, ids = children(scores, level_logits[level - 1])  # [k*k]
        listed.append((scores, ids, frontier[:, None].expand(-1, TOPK).flatten()))
        if level == STEPS - 1:
            break
        best = static_tree.best(scores, TOPK)  # [k]
        scores, ids = scores.index_select(0, best), ids.index_select(0, best)  # [k]
        frontier = count + best  # [k]
    all_scores, all_ids, parents = (torch.cat(c) for c in zip(*listed, strict=True))
    nodes, parents, node_depths = static_tree.choose_nodes(all_scores, all_ids, parents,
                                                           depths, NODES)
    return nodes, parents, node_depths, static_tree.visibility(parents, STEPS)


def chain_choice(root_logits, level_logits, depths):
    """A chain's choice of the same logits: one argmax a step, the floor."""
    picks = [root_logits[0].argmax().view(1)] + [
        level_logits[level, 0].argmax().view(1) for level in range(STEPS - 1)]
    return torch.cat(picks)  # [S]


def captured(fn, inputs, device: str):
    """fn compiled and, on CUDA, captured in one CUDA graph: a call that replays it."""
    compiled = torch.compile(fn)
    for _ in range(3):
        compiled(*inputs)
    if device != "cuda":
        return lambda: compiled(*inputs)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        compiled(*inputs)
    return graph.replay


def microseconds(replay, device: str, repeats: int) -> float:
    """Microseconds a call, over `repeats` calls back to back."""
    replay()
    if device != "cuda":
        started = time.perf_counter()
        for _ in range(repeats):
            replay()
        return 1e6 * (time.perf_counter() - started) / repeats
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        replay()
    end.record()
    torch.cuda.synchronize()
    return 1000 * start.elapsed_time(end) / repeats


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved repeats")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    dtype, device = getattr(torch, args.dtype), torch.device(args.device)
    generator = torch.Generator().manual_seed(0)
    inputs = (torch.randn(1, DRAFT_VOCAB, generator=generator).to(device, dtype),  # [1, D]
              torch.randn(STEPS - 1, TOPK, DRAFT_VOCAB,
                          generator=generator).to(device, dtype),  # [S-1, k, D]
              static_tree.candidate_depths(STEPS, TOPK, device))  # [M]
    want = tree_choice(library_topk, *inputs)
    functions = {name: (lambda *a, f=f: tree_choice(f, *a)) for name, f in VARIANTS.items()}
    functions["chain's argmax"] = chain_choice
    replays = {}
    for name, fn in functions.items():
        try:  # a variant that fails here is reported and left out, not the run lost
            if name != "chain's argmax":
                same = all(torch.equal(g, w) for g, w in zip(fn(*inputs), want, strict=True))
                print(f"{name}: the same tree as torch.topk's: {same}", flush=True)
            replays[name] = captured(fn, inputs, device.type)
        except Exception as error:  # noqa: BLE001
            print(f"{name}: failed: {type(error).__name__}: {error}"[:2000], flush=True)
    device_name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for round_ in range(args.rounds):  # interleaved
        for name, replay in replays.items():
            row = {"variant": name, "us_per_choice": round(microseconds(replay, device.type,
                                                                         args.repeats), 2),
                   "round": round_, "device": device_name, "dtype": args.dtype,
                   "draft_vocab": DRAFT_VOCAB, "tree": f"{STEPS}x{TOPK}/{NODES + 1}"}
            print(json.dumps(row), flush=True)
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
