"""Is a speculative output the target's greedy output? Where it is not, how far apart were the
two tokens in the target's own logits at the first difference: float32 sums in another order
(a batch's longer, holed cache; a server's verify kernel against its one-token kernel) can
fall either way at a near tie and only there, so a near tie is not a broken drafter or engine.
"""

from __future__ import annotations

from draftsmith.config import TargetConfig
from draftsmith.serve.embedded import TargetRunner

# A near tie, as a share of the largest logit's size: float32 sums in another order move logits
# by about 1e-6 of it, a wrong token by far more.
NEAR_TIE = 1e-4


def first_difference(runner, prompt: list[int], reference: list[int], got: list[int]) -> dict:
    """Where `got` leaves `reference` (plain greedy decoding of `prompt`) and the target's
    logit gap there between its token and the one taken, from one forward of the prompt and
    the reference up to that point: a `near_tie` when float32 rounding could explain it.
    runner None: the position only."""
    position = next((i for i, (a, b) in enumerate(zip(reference, got, strict=False))
                     if a != b), None)
    if position is None or runner is None:  # a prefix (no token to weigh), or not weighed
        return {"position": min(len(reference), len(got)) if position is None else position,
                "gap": None, "near_tie": False}
    sequence = prompt + reference[:position]
    logits, _ = runner.forward(sequence, runner.new_cache(len(sequence)))  # [T, V]
    last = logits[-1].float()  # [V]
    gap = float(last[reference[position]] - last[got[position]])
    return {"position": position, "gap": gap,
            "near_tie": abs(gap) <= NEAR_TIE * float(last.abs().max())}


def weigh_differences(target_path: str, target_cfg: TargetConfig, prompts: list[list[int]],
                      reference: list[list[int]], served: list[list[int]]) -> list[dict]:
    """Each served output that is not its reference (a plain server's greedy output of the
    same prompt) weighed by the target itself (`first_difference`), loaded only when some
    differ in float32: a server's verify forward and its one-token forward are different
    kernels, which can fall either way at a near tie and only there. In reduced precision
    they round apart by far more, so only the positions are given."""
    differing = [i for i, (a, b) in enumerate(zip(reference, served, strict=True)) if a != b]
    if target_cfg.dtype != "float32":  # differences are expected there and nothing judges
        return [{"prompt": i, **first_difference(None, prompts[i], reference[i], served[i])}
                for i in differing]  # them: no target to load beside the server's host
    if not differing:
        return []
    from draftsmith.target import load_target_model

    model = load_target_model(target_path, target_cfg.device, target_cfg.dtype)
    runner = TargetRunner(model, aux_layer_ids=[0])  # a runner keeps aux states; unused here
    try:
        return [{"prompt": i, **first_difference(runner, prompts[i], reference[i], served[i])}
                for i in differing]
    finally:
        runner.close()
