"""A stand-in for DARL's gateway on 127.0.0.1: answers chat completions (a tool call to `add`
while the request offers tools and holds no tool result, else a text answer), can fail the next
requests with a 500, and records each request's path, Authorization and Idempotency-Key."""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass(frozen=True)
class SeenRequest:
    path: str
    authorization: str | None
    idempotency_key: str | None
    status: int


def _answer(request: dict[str, Any]) -> dict[str, Any]:
    messages = request.get("messages", [])
    tool_results = [m for m in messages if m.get("role") == "tool"]
    if request.get("tools") and not tool_results:
        message: dict[str, Any] = {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "add", "arguments": json.dumps({"a": 2, "b": 3})},
                }
            ],
        }
        finish = "tool_calls"
    else:
        last = tool_results[-1] if tool_results else messages[-1]
        message = {"role": "assistant", "content": f"answer to {last['content']}"}
        finish = "stop"
    return {
        "id": "chatcmpl-stub",
        "object": "chat.completion",
        "created": 0,
        "model": request.get("model", "policy"),
        "choices": [{"index": 0, "finish_reason": finish, "message": message}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }


class StubGateway:
    def __init__(self) -> None:
        self.seen: list[SeenRequest] = []
        self._failures = 0
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler_class())
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def port(self) -> int:
        return self._server.server_address[1]

    def base_url(self, rollout_id: str) -> str:
        return f"http://127.0.0.1:{self.port}/rollouts/{rollout_id}/v1"

    def fail_next(self, count: int) -> None:
        """The next `count` requests are answered 500."""
        with self._lock:
            self._failures = count

    def start(self) -> StubGateway:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)

    def _reply(self, path: str, headers: Any, body: bytes) -> tuple[int, dict[str, Any]]:
        with self._lock:
            failing = self._failures > 0
            self._failures -= failing
            status = 500 if failing else 200
            if not path.endswith("/chat/completions"):
                status = 404
            key = headers.get("Idempotency-Key")
            self.seen.append(SeenRequest(path, headers.get("Authorization"), key, status))
        if status == 404:
            return status, {"error": {"message": f"no route {path}"}}
        if failing:
            return status, {"error": {"message": "stub gateway: failing this try"}}
        return status, _answer(json.loads(body))

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                status, answer = stub._reply(self.path, self.headers, body)
                data = json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        return Handler
