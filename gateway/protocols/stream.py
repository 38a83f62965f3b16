"""What every agent protocol's stream shares, below the translations that build them: the
`StreamTranslation` a protocol's stream implements, `ChatAnswer` (the parts of a chat
completion a protocol's answer is built from) and the SSE event they write."""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from typing import Any


class ChatAnswer:
    """The parts of a chat completion (whole, or assembled from a stream) a translation reads."""

    def __init__(self, response: dict[str, Any]) -> None:
        choice = (response.get("choices") or [{}])[0]
        message = choice.get("message") or {}
        self.model = str(response.get("model") or "")
        self.text = str(message.get("content") or "")
        self.tool_calls: list[dict[str, Any]] = list(message.get("tool_calls") or [])
        self.finish_reason = choice.get("finish_reason")
        # vLLM says which stop string ended the answer (None for EOS).
        self.stop_reason = choice.get("stop_reason")
        self.prompt_tokens = len(response.get("prompt_token_ids") or [])
        self.completion_tokens = len(choice.get("token_ids") or [])
        logprobs = choice.get("logprobs") or {}
        self.logprobs: list[dict[str, Any]] = list(logprobs.get("content") or [])


class StreamTranslation(ABC):
    """Turns the policy server's chat chunks into the agent's protocol's SSE events."""

    @abstractmethod
    def chunk(self, chunk: dict[str, Any]) -> list[bytes]:
        """The events for one upstream chunk, as it arrives."""

    @abstractmethod
    def done(self, response: dict[str, Any]) -> list[bytes]:
        """The closing events, once the call is recorded (`response` is the assembled answer)."""

    @abstractmethod
    def error(self, message: str, code: str) -> bytes:
        """The event that tells the agent the call failed mid-stream."""


def sse_event(name: str, data: dict[str, Any]) -> bytes:
    return f"event: {name}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()
