"""Acceptance length from SGLang's per-request metrics (`meta_info` of finished /generate
responses): tokens generated per verify forward, summed before dividing."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def acceptance_length(meta_infos: Iterable[dict[str, Any]]) -> float:
    """sum(completion_tokens) / sum(spec_verify_ct). A mean of per-request spec_accept_length
    would weigh a 3-token answer like a 3000-token one."""
    tokens = verifies = 0
    for meta in meta_infos:
        if "spec_verify_ct" not in meta:
            raise ValueError("meta_info has no spec_verify_ct: the server is not running "
                             "speculative decoding (check --speculative-algorithm)")
        tokens += meta["completion_tokens"]
        verifies += meta["spec_verify_ct"]
    if verifies == 0:
        raise ValueError("no verify steps in any response: nothing was decoded speculatively")
    return tokens / verifies
