"""A cheap OpenAI-compatible server that injects faults into chosen replies, for the fault and
soak tests of generate.

It answers every prompt at once with a text derived from the prompt (`expected_answer`), so a
test can check that each record holds its own prompt's answer and nothing else. A fault plan
maps a prompt (the last message's exact text) to a fault and the number of attempts it hits
(None: every attempt). Loopback only; one thread per connection, keep-alive on, no model.
"""

from __future__ import annotations

import hashlib
import json
import socket
import threading
from collections import Counter
from collections.abc import Callable
from http.server import ThreadingHTTPServer

from tests.json_http import JsonHandler, LoopbackServer

# 200 replies that are no usable completion: the client must treat each as a failed attempt.
MALFORMED = ("truncated_json", "not_json", "not_an_object", "null_content", "missing_content",
             "no_choices", "empty_choices", "error_body", "message_not_object",
             "content_not_text", "choices_not_a_list", "usage_not_counts", "reasoning_not_text",
             "finish_reason_not_text")
# Faults of the transport or the status line: retried as before.
TRANSPORT = ("cut_body", "no_response", "http_500", "http_429")
FAULTS = MALFORMED + TRANSPORT


def expected_answer(prompt: str) -> str:
    return "answer " + hashlib.sha256(prompt.encode()).hexdigest()[:16]


def completion(prompt: str) -> dict:
    return {"id": "chatcmpl-fault-server", "object": "chat.completion", "model": "fault-server",
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": expected_answer(prompt)}}],
            "usage": {"prompt_tokens": len(prompt) // 4 + 1, "completion_tokens": 3,
                      "total_tokens": len(prompt) // 4 + 4}}


def faulty_body(fault: str, prompt: str) -> dict | list | str:
    """The body of a malformed 200 (a str is sent as it is, not as JSON)."""
    body = completion(prompt)
    message = body["choices"][0]["message"]
    if fault == "truncated_json":
        text = json.dumps(body)
        return text[: len(text) // 2]
    if fault == "not_json":
        return "<html><body>502 Bad Gateway</body></html>"
    if fault == "not_an_object":
        return [body]
    if fault == "null_content":
        message["content"] = None
    elif fault == "missing_content":
        del message["content"]
    elif fault == "no_choices":
        del body["choices"]
    elif fault == "empty_choices":
        body["choices"] = []
    elif fault == "error_body":
        return {"error": {"message": "the model is overloaded", "code": 503}}
    elif fault == "message_not_object":
        body["choices"][0]["message"] = expected_answer(prompt)
    elif fault == "content_not_text":
        message["content"] = {"text": expected_answer(prompt)}
    elif fault == "choices_not_a_list":
        body["choices"] = {"0": body["choices"][0]}
    elif fault == "usage_not_counts":
        body["usage"]["completion_tokens"] = "three"
    elif fault == "reasoning_not_text":
        message["reasoning_content"] = ["thinking"]
    elif fault == "finish_reason_not_text":
        body["choices"][0]["finish_reason"] = 1
    else:
        raise ValueError(f"unknown fault {fault!r}")
    return body


class _QuietServer(ThreadingHTTPServer):
    daemon_threads = True
    # 64 clients connect at once: socketserver's default backlog of 5 would drop some, and a
    # connection that never reaches the server is a fault this server did not plan.
    request_queue_size = 256

    def handle_error(self, request, client_address) -> None:
        pass  # a client killed mid-request leaves broken pipes behind: expected here


class FaultServer(LoopbackServer):
    server_class = _QuietServer

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.reset()
        self.start(self._handler())

    def reset(self) -> None:
        with self.lock:
            self.plan: dict[str, tuple[str, int | None]] = {}  # prompt -> (fault, attempts)
            self.attempts: Counter[str] = Counter()  # prompt -> requests received
            self.answers: Counter[str] = Counter()  # prompt -> healthy 200s sent
            self.faults: Counter[str] = Counter()  # fault -> times sent
            self.after_answer: Callable[[int], None] | None = None

    def inject(self, prompt: str, fault: str, attempts: int | None = None) -> None:
        """`fault` on the first `attempts` requests for `prompt` (None: on every one)."""
        if fault not in FAULTS:
            raise ValueError(f"unknown fault {fault!r}")
        with self.lock:
            self.plan[prompt] = (fault, attempts)

    def _handler(self):
        server = self

        class Handler(JsonHandler):
            protocol_version = "HTTP/1.1"  # keep-alive: 64 clients do not reconnect each time

            def drop(self) -> None:
                self.close_connection = True
                self.wfile.flush()
                self.connection.shutdown(socket.SHUT_RDWR)

            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                prompt = str(self.read_json()["messages"][-1]["content"])
                with server.lock:
                    attempt = server.attempts[prompt]
                    server.attempts[prompt] += 1
                    fault, times = server.plan.get(prompt, (None, None))
                    if fault is not None and times is not None and attempt >= times:
                        fault = None
                    if fault is not None:
                        server.faults[fault] += 1
                if fault is None:
                    self.send_json(200, completion(prompt))
                    with server.lock:
                        server.answers[prompt] += 1
                        answered, hook = sum(server.answers.values()), server.after_answer
                    if hook is not None:
                        hook(answered)
                elif fault == "http_500":
                    self.send_json(500, {"error": "injected"})
                elif fault == "http_429":
                    self.send_json(429, {"error": "injected"}, {"Retry-After": "0"})
                elif fault == "no_response":
                    self.drop()
                elif fault == "cut_body":  # the headers promise more than ever arrives
                    data = json.dumps(completion(prompt)).encode()
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data[: len(data) // 2])
                    self.drop()
                else:
                    body = faulty_body(fault, prompt)
                    if isinstance(body, str):
                        self.send_text(200, body, "application/json" if fault ==
                                       "truncated_json" else "text/html")
                    else:
                        self.send_json(200, body)

        return Handler
