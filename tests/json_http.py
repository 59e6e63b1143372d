"""The JSON request handler the test stand-in servers share (SGLang, capture, OpenAI proxy)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class JsonHandler(BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:  # quiet: the tests read their own logs
        pass

    def read_json(self) -> dict:
        return json.loads(self.rfile.read(int(self.headers["Content-Length"])))

    def send_json(self, code: int, body: dict, headers: dict[str, str] | None = None) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(data)

    def send_text(self, code: int, text: str, content_type: str = "application/json") -> None:
        """A body sent as it is (e.g. JSON cut short, an HTML error page)."""
        data = text.encode()
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


class LoopbackServer:
    """An HTTP server on 127.0.0.1 (a free port) serving `handler` from a daemon thread: the
    part every OpenAI-shaped stand-in shares. Subclasses build the handler and their state."""

    server_class: type[ThreadingHTTPServer] = ThreadingHTTPServer

    def start(self, handler: type[BaseHTTPRequestHandler]) -> None:
        self.server = self.server_class(("127.0.0.1", 0), handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
