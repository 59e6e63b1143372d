"""A real OpenAI-compatible server for the tests, and a fault-injecting proxy in front of it.

`ServeProcess` runs `transformers serve` on a loopback port with a local model directory,
offline, in its own process group (so kill -9 takes the whole server down, as a crash would).
`FaultProxy` forwards to it and can answer 429/503 a few times, hang on a request, fail chosen
prompts always, require an API key, add `reasoning_content` the way reasoning servers do, and
count answers per prompt; a hook runs after each answer (the kill test uses it).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from http.server import ThreadingHTTPServer
from pathlib import Path

import httpx

from tests.json_http import JsonHandler


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServeProcess:
    def __init__(self, model_dir: Path, log_file: Path, port: int | None = None):
        self.model_dir, self.log_file = model_dir, log_file
        self.port = port or free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 180.0) -> None:
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "OMP_NUM_THREADS": "1"}
        # The console script of this environment's transformers (its module path moved in v5).
        cli = Path(sys.executable).with_name("transformers")
        argv = [str(cli) if cli.is_file() else "transformers",
                "serve", "--host", "127.0.0.1", "--port", str(self.port), "--device", "cpu",
                "--log-level", "info", str(self.model_dir)]
        log = open(self.log_file, "ab")  # noqa: SIM115 - the child owns it while it runs
        self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"transformers serve exited with {self.proc.returncode}: "
                                   + self.log_file.read_text()[-3000:])
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.kill()
        raise RuntimeError("transformers serve did not become healthy: "
                           + self.log_file.read_text()[-3000:])

    def kill(self) -> None:
        """SIGKILL to the whole process group: no shutdown, no goodbye, like a crashed host."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


def prompt_key(body: dict) -> str:
    return json.dumps(body.get("messages"), sort_keys=True)


class FaultProxy:
    def __init__(self, upstream: str):
        self.upstream = upstream
        self.lock = threading.Lock()
        self.fail_next: deque[tuple[int, dict[str, str]]] = deque()
        self.always_fail: dict[str, int] = {}  # substring of the last message -> status
        self.required_key: str | None = None
        self.add_reasoning = False
        self.think_in_content = False
        self.after_answer: Callable[[int], None] | None = None
        self.reset()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def reset(self) -> None:
        with self.lock:
            self.fail_next.clear()
            self.always_fail.clear()
            self.required_key = None
            self.add_reasoning = False
            self.think_in_content = False  # a reasoning model served without a parser
            self.after_answer = None
            self.stall_next: deque[float] = deque()  # seconds to hold a request before sending
            self.answers: Counter[str] = Counter()  # prompt -> 200 answers sent
            self.requests = 0
            self.auth_headers: list[str | None] = []
            self.in_flight: Counter[int] = Counter()  # max_tokens -> requests in flight now
            self.max_in_flight: Counter[int] = Counter()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

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
