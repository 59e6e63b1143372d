"""Does the serving engine run the drafter the way it was trained?

The most common silent failure: the engine loads the drafter and runs it another way, and
only the acceptance shows it (vLLM issue #50170: layer ids missing from a config gave 1.04
instead of 2.77; vLLM reads an absent norm_before_residual as true). After a served benchmark,
the same drafter (the trained checkpoint when the run trained it) is replayed in draftsmith's
own engine over the served greedy outputs: the target's aux states for every position from
one forward, each round drafted as the embedded engine drafts it and checked against those
outputs (`EmbeddedSpeculativeEngine.replay`). That is the acceptance the engine should
measure; the embedded engine and vLLM agree within a few percent on a correctly served
drafter (tests/test_vllm.py). A served acceptance below GUARD_THRESHOLD of it is a problem,
reported with the likely causes.

The outputs are the baseline server's (the target alone) when the benchmark measured one,
else the speculative server's own (greedy speculative decoding is the target's greedy output).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# Served / replayed acceptance below this is a problem. A correctly served drafter measures
# within 1% of the replay on the quality runs and within 5% in the tests' tiny vLLM runs (a
# few hundred rounds); the failures it is for lose a third or more (1.04 against 2.77).
GUARD_THRESHOLD = 0.9
LIKELY_CAUSES = (
    "aux layer ids (the engine captures other target layers than training did: check the ids "
    "the config says, eagle_aux_hidden_state_layer_ids / aux_hidden_state_layer_ids, against "
    "the extracted ones)",
    "EAGLE-3.1 norms (norm_before_residual, norm_before_fc, fc_norm, norm_output: vLLM reads "
    "an absent norm_before_residual as true)",
    "d2t (the draft-to-target map must hold offsets, target = draft + d2t)",
    "the draft vocab (draft_vocab_size, and whether the engine loads d2t at all)",
    "the chat template (the engine must tokenise prompts as training did)",
)


def replayed_acceptance(drafter_dir: str | Path, target_path: str, target_cfg, family: str,
                        num_steps: int, prompts: list[list[int]],
                        outputs: list[list[int]]) -> dict[str, Any]:
    """Greedy decoding of `outputs` replayed with the drafter at `drafter_dir` (any layout,
    native included) drafting `num_steps` tokens a round: rounds, tokens and acceptance length
    (tokens per verify round, 1 + accepted drafts per round)."""
    from draftsmith.serve.embedded import EmbeddedSpeculativeEngine
    from draftsmith.target import load_target_model

    model = load_target_model(target_path, target_cfg.device, target_cfg.dtype)
    engine = EmbeddedSpeculativeEngine.load(model, drafter_dir, num_steps, family)
    try:
        rounds = tokens = 0
        for prompt, output in zip(prompts, outputs, strict=True):
            replay = engine.replay(prompt, output)
            rounds += replay.verify_rounds
            tokens += sum(replay.round_tokens)
    finally:
        engine.runner.close()
    if not rounds:
        raise ValueError("the served outputs are one token or none: nothing to replay")
    return {"rounds": rounds, "tokens": tokens, "acceptance_length": round(tokens / rounds, 4)}


def judge(served: float, replayed: float, threshold: float = GUARD_THRESHOLD) -> dict[str, Any]:
    """The guard's verdict on a served acceptance against the replayed one."""
    ratio = served / replayed
    verdict: dict[str, Any] = {"served_acceptance": round(served, 4),
                               "replayed_acceptance": round(replayed, 4),
                               "ratio": round(ratio, 4), "threshold": threshold,
                               "ok": ratio >= threshold}
    if not verdict["ok"]:
        verdict["problem"] = (
            f"the engine runs the drafter differently from how it was trained: served "
            f"acceptance {served:.3f} is {100 * ratio:.0f}% of the {replayed:.3f} the same "
            f"drafter reaches replayed over the same greedy outputs (below "
            f"{100 * threshold:.0f}%). Likely causes: " + "; ".join(LIKELY_CAUSES))
    return verdict


def run_guard(drafter_dir: str | Path, target_path: str, target_cfg, family: str,
              num_steps: int, prompts: list[list[int]], outputs: list[list[int]],
              served: float, outputs_from: str, threshold: float = GUARD_THRESHOLD
              ) -> dict[str, Any]:
    """Replay, then judge; the verdict says which drafter and whose outputs it replayed."""
    replay = replayed_acceptance(drafter_dir, target_path, target_cfg, family, num_steps,
                                 prompts, outputs)
    verdict = {**judge(served, replay["acceptance_length"], threshold),
               "replayed_rounds": replay["rounds"], "replayed_drafter": str(drafter_dir),
               "outputs_from": outputs_from}
    if verdict["ok"]:
        log.info("benchmark guard: served acceptance %.3f, replayed %.3f (%s of it): the "
                 "engine runs the drafter as trained", served, replay["acceptance_length"],
                 f"{100 * verdict['ratio']:.0f}%")
    else:
        log.error("benchmark guard: %s", verdict["problem"])
    return verdict
