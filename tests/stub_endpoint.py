"""A stub OpenAI-compatible endpoint that records each request body and streams a fixed chat answer with
log-probabilities and a tool call in pieces: ``transformers serve`` accepts ``logprobs``,
``response_format`` and ``tools`` but ignores them, so their pass-through is tested against this."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

#: the events of the answer, as a server streams them (a tool call's arguments in two pieces)
EVENTS = [
    {"choices": [{"index": 0, "delta": {"role": "assistant", "content": "Look"},
                  "logprobs": {"content": [{"token": "Look", "logprob": -0.5, "top_logprobs": []}]}}]},
    {"choices": [{"index": 0, "delta": {"content": "ing"},
                  "logprobs": {"content": [{"token": "ing", "logprob": -0.25, "top_logprobs": []}]}}]},
    {"choices": [{"index": 0, "delta": {"tool_calls": [
        {"index": 0, "id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": '}}
    ]}}]},
    {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": '"Oslo"}'}}]}}]},
    {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
    {"choices": [], "usage": {"prompt_tokens": 11, "completion_tokens": 7, "total_tokens": 18}},
]  # fmt: skip


class StubEndpoint:
    """The stub on a free loopback port (``url``: its OpenAI base URL); ``bodies``: (path, body) received."""

    def __init__(self) -> None:
        self.bodies: list[tuple[str, dict]] = []
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                stub.bodies.append((self.path, body))
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                for event in EVENTS:
                    self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
                self.wfile.write(b"data: [DONE]\n\n")

            def log_message(self, *args) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}/v1"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> StubEndpoint:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()
