"""A draft tree chosen on the device, for the static path's captured drafting round.

The dynamic path (`EmbeddedSpeculativeEngine._draft_tree`) grows its tree in Python lists and
reads every level's top-k on the host: a wait for the GPU at each level, and nothing a CUDA
graph can hold. Here the shapes are fixed by (num_steps, topk, num_draft_tokens), so a round's
tree is chosen by tensor operations alone and captured with the drafter's steps. Candidates
are laid out as the dynamic path lists them and chosen with its tie-breaks (its stable sorts:
an equal score goes to the candidate listed first, which is never deeper), and scores are
summed in float64 as Python sums them there: both paths draft the same tree.

The candidates, in order: the root's topk children (depth 1), then for each later depth the
topk children of each of the topk frontier nodes, frontier row by row:
topk + (num_steps - 1) * topk**2 in all.
"""

from __future__ import annotations

import torch

from draftsmith.serve.row_topk import row_topk


def candidate_depths(num_steps: int, topk: int, device: torch.device) -> torch.Tensor:
    """Each candidate's depth in the layout above: [M]."""
    per_depth = [topk] + [topk * topk] * (num_steps - 1)
    return torch.repeat_interleave(torch.arange(1, num_steps + 1, device=device),
                                   torch.tensor(per_depth, device=device))  # [M]


def children(parent_scores: torch.Tensor, logits: torch.Tensor, topk: int
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """The topk children of each of F parents: their scores (the parent's plus the child's
    draft log-probability, float64) and draft-vocabulary ids, parent by parent. parent_scores
    [F] float64, logits [F, D] -> [F * topk], [F * topk]."""
    logp, ids = row_topk(logits, topk)  # [F, k], [F, k]
    return (parent_scores[:, None] + logp.double()).flatten(), ids.flatten()  # [F*k], [F*k]


def places(scores: torch.Tensor) -> torch.Tensor:
    """Each score's place in Python's stable sort on -score, as the dynamic path sorts (an
    equal score goes to the lower index): scores [M] -> [M], a permutation of 0..M-1. By
    counting, not sorting: M is a few dozen, and one fused comparison beats a sort kernel."""
    index = torch.arange(scores.shape[0], device=scores.device)  # [M]
    ahead = (scores[None, :] > scores[:, None]) | (
        (scores[None, :] == scores[:, None]) & (index[None, :] < index[:, None]))  # [M, M]
    return ahead.sum(-1)  # [M]


def best(scores: torch.Tensor, count: int) -> torch.Tensor:
    """The indices of the `count` highest scores, best first [count] (see `places`)."""
    wanted = torch.arange(count, device=scores.device)  # [count]
    return (places(scores)[None, :] == wanted[:, None]).int().argmax(-1)  # [count]


def choose_nodes(scores: torch.Tensor, tokens: torch.Tensor, parent_candidates: torch.Tensor,
                 depths: torch.Tensor, nodes: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The tree: the `nodes` best candidates in verify order (by depth, then as listed), as
    their tokens [N], their parents' verify indices [N] (0: the root) and depths [N]. scores
    [M] float64, tokens [M], depths [M]; parent_candidates [M]: each candidate's parent as a
    candidate index, -1 for the root. A parent scores at least its children (log-probabilities
    are at most 0) and wins their ties, so every chosen node's parent is chosen too."""
    chosen = places(scores) < nodes  # [M]
    # candidate order is verify order: a chosen candidate's verify index counts the chosen
    # up to it; the root's is 0, which a parent of -1 reads from the appended slot
    verify_index = chosen.long().cumsum(0) * chosen  # [M]
    verify_index = torch.cat([verify_index, verify_index.new_zeros(1)])  # [M+1]
    wanted = torch.arange(1, nodes + 1, device=scores.device)  # [N]
    picked = (verify_index[None, :-1] == wanted[:, None]).int().argmax(-1)  # [N]
    parents = parent_candidates.index_select(0, picked)  # [N]
    parents = verify_index.index_select(0, torch.where(parents < 0, scores.shape[0], parents))
    return tokens.index_select(0, picked), parents, depths.index_select(0, picked)  # [N] each


def visibility(parents: torch.Tensor, num_steps: int) -> torch.Tensor:
    """Which verify positions each sees within the tree [N+1, N+1]: itself and its ancestors,
    the root (index 0) included. parents [N]: verify indices, parents before children."""
    parent_of = torch.cat([parents.new_zeros(1), parents])  # [N+1]: the root its own
    size = parent_of.shape[0]
    visible = torch.eye(size, dtype=torch.bool, device=parents.device)  # [N+1, N+1]
    for _ in range(num_steps):  # a node num_steps deep has num_steps ancestors
        visible = visible | visible.index_select(0, parent_of)  # [N+1, N+1]
    return visible


def walk(nodes: torch.Tensor, parents: torch.Tensor, picks: torch.Tensor, num_steps: int
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification of a tree on the device, as `EmbeddedSpeculativeEngine._verify_tree`
    walks it on the host: from the root, follow the child (the first in verify order) that
    holds the target's pick, at most num_steps times. nodes, parents [N]; picks [N+1]: the
    target's argmax after each verify index. Returns the verify indices kept [num_steps + 1]
    (the root, the accepted path, then its last one repeated) and how many nodes were
    accepted [1]."""
    current = parents.new_zeros(1)  # [1]: the root
    found = torch.ones(1, dtype=torch.bool, device=parents.device)  # [1]
    accepted = parents.new_zeros(1)  # [1]
    kept = [current]
    for _ in range(num_steps):
        match = (parents == current) & (nodes == picks.index_select(0, current))  # [N]
        found = found & match.any(0, keepdim=True)  # [1]
        current = torch.where(found, match.long().argmax(0, keepdim=True) + 1, current)  # [1]
        accepted = accepted + found.long()  # [1]
        kept.append(current)
    return torch.cat(kept), accepted  # [S+1], [1]
