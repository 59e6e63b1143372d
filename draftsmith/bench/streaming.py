"""What both load clients share: server-sent events of one streamed POST, and a batch of
requests with at most `concurrency` in flight."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import httpx

Result = TypeVar("Result")


async def stream_events(client: httpx.AsyncClient, path: str, payload: dict[str, Any]
                        ) -> AsyncIterator[dict[str, Any]]:
    """POST payload to path and yield each `data:` event as JSON, until `[DONE]`. A status
    other than 200 raises, naming the path and the start of the body."""
    async with client.stream("POST", path, json=payload) as response:
        if response.status_code != 200:
            body = (await response.aread()).decode(errors="replace")
            raise RuntimeError(f"{path} answered {response.status_code}: {body[:300]}")
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line.removeprefix("data:").strip()
            if data == "[DONE]":
                break
            yield json.loads(data)


async def run_bounded(url: str, count: int, concurrency: int, timeout_s: float,
                      request: Callable[[httpx.AsyncClient, int], Awaitable[Result]]
                      ) -> tuple[list[Result], float]:
    """request(client, i) for i in range(count), at most `concurrency` in flight on one
    client; results in order, and the wall time."""
    limit = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=timeout_s) as client:

        async def bounded(i: int) -> Result:
            async with limit:
                return await request(client, i)

        started = time.perf_counter()
        results = await asyncio.gather(*(bounded(i) for i in range(count)))
    return list(results), time.perf_counter() - started
