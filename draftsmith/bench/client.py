"""Benchmark client for a served endpoint that speaks SGLang's native /generate.

Requests are streamed, so time to first token and the gaps between chunks are measured where
the user sees them; acceptance comes from each finished response's meta_info and is aggregated
as sum(completion_tokens) / sum(spec_verify_ct).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from draftsmith.bench.acceptance import acceptance_length
from draftsmith.bench.streaming import run_bounded, stream_events


@dataclass
class RequestResult:
    prompt_tokens: int
    output_ids: list[int]
    meta_info: dict[str, Any]
    ttft_s: float
    latency_s: float
    chunk_gaps_s: list[float] = field(default_factory=list)

    @property
    def completion_tokens(self) -> int:
        return int(self.meta_info.get("completion_tokens", len(self.output_ids)))


async def _one_request(client: httpx.AsyncClient, prompt: list[int], max_new_tokens: int,
                       temperature: float) -> RequestResult:
    payload = {"input_ids": prompt, "stream": True,
               "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": temperature}}
    started = time.perf_counter()
    first = last = None
    gaps: list[float] = []
    final: dict[str, Any] = {}
    async for event in stream_events(client, "/generate", payload):
        now = time.perf_counter()
        if first is None:
            first = now
        else:
            gaps.append(now - last)
        last = now
        final = event
    if first is None:
        raise RuntimeError("/generate streamed no chunk")
    return RequestResult(len(prompt), list(final.get("output_ids", [])),
                         final.get("meta_info", {}), first - started, last - started, gaps)


async def run_load(url: str, prompts: list[list[int]], *, max_new_tokens: int,
                   temperature: float = 0.0, concurrency: int = 1,
                   timeout_s: float = 600.0) -> tuple[list[RequestResult], float]:
    """Send every prompt with at most `concurrency` in flight; returns results (in prompt
    order) and the wall time."""
    return await run_bounded(
        url, len(prompts), concurrency, timeout_s,
        lambda client, i: _one_request(client, prompts[i], max_new_tokens, temperature))


def summarize(results: list[RequestResult], wall_s: float, speculative: bool = True
              ) -> dict[str, Any]:
    tokens = sum(r.completion_tokens for r in results)
    gaps = [g for r in results for g in r.chunk_gaps_s]
    summary = {
        "requests": len(results),
        "completion_tokens": tokens,
        "tokens_per_s": round(tokens / wall_s, 2) if wall_s > 0 else 0.0,
        "ttft_p50_s": round(statistics.median(r.ttft_s for r in results), 4),
        "ttft_max_s": round(max(r.ttft_s for r in results), 4),
        "inter_chunk_mean_s": round(statistics.fmean(gaps), 5) if gaps else None,
        "per_token_latency_s": round(sum(r.latency_s for r in results) / max(tokens, 1), 5),
    }
    if speculative:
        summary["acceptance_length"] = round(acceptance_length(r.meta_info for r in results), 3)
    return summary
