"""Acceptance length from SGLang's per-request metrics (`meta_info` of finished /generate
responses): tokens generated per verify forward, summed before dividing."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def acceptance_length(meta_infos: Iterable[dict[str, Any]]) -> float:
    """sum(completion_tokens) / sum(spec_verify_ct) over the replies that had a verify step.
    A mean of per-request spec_accept_length would weigh a 3-token answer like a 3000-token
    one.

    SGLang (0.5.23, managers/tokenizer_manager.py) adds spec_verify_ct and spec_accept_length
    only when a request had at least one verify step: a reply whose only token came from the
    prefill (its first token was EOS, or max_new_tokens was 1) has neither, and was not
    decoded speculatively at all, so it counts in neither sum. A longer reply without them
    means the server does not speculate."""
    tokens = verifies = 0
    for meta in meta_infos:
        if "spec_verify_ct" not in meta:
            if meta.get("completion_tokens", 0) > 1:
                raise ValueError(
                    f"meta_info has no spec_verify_ct for a reply of "
                    f"{meta['completion_tokens']} tokens: the server is not running "
                    "speculative decoding (check --speculative-algorithm)")
            continue
        tokens += meta["completion_tokens"]
        verifies += meta["spec_verify_ct"]
    if verifies == 0:
        raise ValueError("no verify steps in any response: nothing was decoded speculatively "
                         "(every reply ended with its first token, or the server does not "
                         "speculate)")
    return tokens / verifies
