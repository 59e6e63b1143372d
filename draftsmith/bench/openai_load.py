"""Load for a server that speaks the OpenAI completions API (vLLM): streamed requests of token-id
prompts, `concurrency` at a time.

Each request streams, so time to first token and the time between tokens are measured where a
user sees them. vLLM's `return_token_ids` puts the generated ids in every chunk; a chunk holds
several tokens when a draft was accepted, so inter-token latency is the time after the first
chunk divided by the tokens that came after it.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from draftsmith.bench.streaming import run_bounded, stream_events


@dataclass
class Completion:
    prompt_tokens: int
    output_ids: list[int]
    ttft_s: float
    latency_s: float
    chunk_tokens: list[int] = field(default_factory=list)  # tokens per streamed chunk
    finish_reason: str | None = None

    @property
    def inter_token_s(self) -> float | None:
        after_first = len(self.output_ids) - (self.chunk_tokens[0] if self.chunk_tokens else 0)
        return (self.latency_s - self.ttft_s) / after_first if after_first > 0 else None


async def stream_completion(client: httpx.AsyncClient, model: str, prompt: list[int],
                            max_tokens: int, temperature: float, seed: int) -> Completion:
    body: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": max_tokens,
                            "temperature": temperature, "stream": True,
                            "return_token_ids": True}
    if temperature > 0:
        body["seed"] = seed  # reproducible sampling per prompt, the same on both servers
    started = time.perf_counter()
    first = last = None
    output: list[int] = []
    chunks: list[int] = []
    finish = None
    async for event in stream_events(client, "/v1/completions", body):
        choice = (event.get("choices") or [{}])[0]
        ids = choice.get("token_ids") or []
        finish = choice.get("finish_reason") or finish
        if not ids:
            continue
        now = time.perf_counter()
        first = first if first is not None else now
        last = now
        output += ids
        chunks.append(len(ids))
    if first is None:
        raise RuntimeError("/v1/completions streamed no token (is return_token_ids supported? "
                           "vLLM 0.10+ has it)")
    return Completion(len(prompt), output, first - started, last - started, chunks, finish)


async def run_completions(url: str, model: str, prompts: list[list[int]], *, max_tokens: int,
                          temperature: float = 0.0, concurrency: int = 1,
                          timeout_s: float = 600.0) -> tuple[list[Completion], float]:
    """Every prompt, at most `concurrency` in flight; results in prompt order, and wall time."""
    return await run_bounded(
        url, len(prompts), concurrency, timeout_s,
        lambda client, i: stream_completion(client, model, prompts[i], max_tokens, temperature,
                                            seed=i))


def summarize(results: list[Completion], wall_s: float) -> dict[str, Any]:
    tokens = sum(len(r.output_ids) for r in results)
    itl = [r.inter_token_s for r in results if r.inter_token_s is not None]
    return {
        "requests": len(results),
        "completion_tokens": tokens,
        "tokens_per_s": round(tokens / wall_s, 2) if wall_s > 0 else 0.0,
        "ttft_p50_s": round(statistics.median(r.ttft_s for r in results), 4),
        "ttft_max_s": round(max(r.ttft_s for r in results), 4),
        "inter_token_mean_s": round(statistics.fmean(itl), 5) if itl else None,
        "tokens_per_chunk": round(tokens / max(sum(len(r.chunk_tokens) for r in results), 1),
                                  3),
    }
