"""A fault-injecting proxy in front of a real OpenAI-compatible server (the tests' vLLM).

`FaultProxy` forwards to it, counts requests in flight and answers per prompt, and injects the
faults a healthy server does not produce: 429/503 a few times, a hung request, prompts that
always fail, a garbled reply (the server's own, cut short or with its content nulled), an outage
(every request answered 502, as a gateway does when the server behind it is gone), a required
API key. A hook runs after each answer (the resume tests use it).
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter, deque
from collections.abc import Callable

import httpx

from tests.json_http import JsonHandler, LoopbackServer


def prompt_key(body: dict) -> str:
    return json.dumps(body.get("messages"), sort_keys=True)


class FaultProxy(LoopbackServer):
    def __init__(self, upstream: str):
        self.upstream = upstream
        self.lock = threading.Lock()
        self.fail_next: deque[tuple[int, dict[str, str]]] = deque()
        self.always_fail: dict[str, int] = {}  # substring of the last message -> status
        self.required_key: str | None = None
        self.after_answer: Callable[[int], None] | None = None
        self.reset()
        self.start(self._handler())

    def reset(self) -> None:
        with self.lock:
            self.fail_next.clear()
            self.always_fail.clear()
            self.required_key = None
            self.down = False  # an outage: the server behind the proxy is gone
            self.think_in_content = False  # a reasoning model served without a parser
            self.add_reasoning = False  # ... and with one: reasoning_content beside the answer
            self.after_answer = None
            self.stall_next: deque[float] = deque()  # seconds to hold a request before sending
            # "truncate" or "null_content": what to do to the next real 200s on their way back.
            self.garble_next: deque[str] = deque()
            self.garbled = 0
            self.answers: Counter[str] = Counter()  # prompt -> 200 answers sent
            self.requests = 0
            self.auth_headers: list[str | None] = []
            self.in_flight: Counter[int] = Counter()  # max_tokens -> requests in flight now
            self.max_in_flight: Counter[int] = Counter()

    def _handler(self):
        proxy = self

        class Handler(JsonHandler):

            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                body = self.read_json()
                max_tokens = body.get("max_tokens", 0)
                with proxy.lock:
                    proxy.requests += 1
                    proxy.auth_headers.append(self.headers.get("Authorization"))
                    if proxy.required_key and self.headers.get("Authorization") != \
                            f"Bearer {proxy.required_key}":
                        return self.send_json(401, {"error": "bad key"})
                    last = str(body["messages"][-1].get("content"))
                    for needle, status in proxy.always_fail.items():
                        if needle in last:
                            return self.send_json(status, {"error": "injected, always"})
                    if proxy.down:
                        return self.send_json(502, {"error": "upstream: connection refused"})
                    if proxy.fail_next:
                        status, headers = proxy.fail_next.popleft()
                        return self.send_json(status, {"error": "injected"}, headers)
                    proxy.in_flight[max_tokens] += 1
                    proxy.max_in_flight[max_tokens] = max(proxy.max_in_flight[max_tokens],
                                                          proxy.in_flight[max_tokens])
                    stall = proxy.stall_next.popleft() if proxy.stall_next else 0.0
                if stall:  # a hung server: the client's timeout must fire first
                    time.sleep(stall)
                    with proxy.lock:
                        proxy.in_flight[max_tokens] -= 1
                    return None
                try:
                    upstream = httpx.post(proxy.upstream + self.path, json=body, timeout=120)
                except httpx.HTTPError as err:  # the server is gone: what a gateway says
                    return self.send_json(502, {"error": f"upstream: {type(err).__name__}"})
                finally:
                    with proxy.lock:
                        proxy.in_flight[max_tokens] -= 1
                payload = upstream.json()
                if upstream.status_code == 200:
                    with proxy.lock:
                        garble = proxy.garble_next.popleft() if proxy.garble_next else None
                        proxy.garbled += garble is not None
                    if garble == "truncate":
                        text = json.dumps(payload)
                        return self.send_text(200, text[: len(text) // 2])
                    if garble == "null_content":
                        payload["choices"][0]["message"]["content"] = None
                        return self.send_json(200, payload)
                    message = payload["choices"][0]["message"]
                    if proxy.add_reasoning:
                        message["reasoning_content"] = "thinking about: " + last[-24:]
                    if proxy.think_in_content:
                        message["content"] = ("<think>\nthinking about it\n</think>\n\n"
                                              + (message.get("content") or ""))
                    with proxy.lock:
                        proxy.answers[prompt_key(body)] += 1
                        answered = sum(proxy.answers.values())
                    self.send_json(200, payload)
                    if proxy.after_answer is not None:
                        proxy.after_answer(answered)
                    return None
                return self.send_json(upstream.status_code, payload)

        return Handler
