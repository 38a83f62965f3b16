"""Chat completion chunks from the policy server as Anthropic's Messages events
(`MessagesStream`).
"""

from __future__ import annotations

import json
from typing import Any

from darl.gateway.protocols.messages.answer import stop_of
from darl.gateway.protocols.messages.protocol import MessagesRequest, tool_input
from darl.gateway.protocols.stream import ChatAnswer, StreamTranslation, sse_event


class MessagesStream(StreamTranslation):
    """Chat chunks as Anthropic's events: `message_start`, per block `content_block_start`,
    its deltas and `content_block_stop`, then `message_delta` and `message_stop` once
    recorded.

    Anthropic's blocks follow one another: a block once stopped takes no more deltas. A chat
    stream may interleave its tool calls' arguments, so only the first tool call streams live
    (its block stays open to the end, whatever arrives for it); every later call is sent whole
    from the recorded answer when the stream is done, as is any call the stream never showed.
    The agent assembles exactly the whole answer."""

    def __init__(self, request: MessagesRequest, call_id: str) -> None:
        self.request = request
        self.call_id = call_id
        self.started = False
        self.blocks = 0
        self.open: int | None = None  # the block index deltas go to
        self.text_block: int | None = None
        # The chat index of the tool call streaming live, and the arguments sent for it.
        self.live: int | None = None
        self.live_arguments = ""
        self.indices: set[int] = set()  # every chat tool call index the stream showed

    def _start(self, chunk: dict[str, Any]) -> list[bytes]:
        self.started = True
        message: dict[str, Any] = {
            "id": f"msg_{self.call_id}",
            "type": "message",
            "role": "assistant",
            "content": [],
            "model": str(chunk.get("model") or self.request.model or ""),
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {
                "input_tokens": len(chunk.get("prompt_token_ids") or []),
                "output_tokens": 0,
            },
        }
        return [sse_event("message_start", {"type": "message_start", "message": message})]

    def _close(self) -> list[bytes]:
        if self.open is None:
            return []
        index, self.open = self.open, None
        return [sse_event("content_block_stop", {"type": "content_block_stop", "index": index})]

    def _open(self, block: dict[str, Any]) -> list[bytes]:
        events = self._close()
        self.open = self.blocks
        self.blocks += 1
        start = {"type": "content_block_start", "index": self.open, "content_block": block}
        return [*events, sse_event("content_block_start", start)]

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return sse_event(
            "content_block_delta",
            {"type": "content_block_delta", "index": self.open, "delta": delta},
        )

    def chunk(self, chunk: dict[str, Any]) -> list[bytes]:
        events = [] if self.started else self._start(chunk)
        for choice in chunk.get("choices") or []:
            if choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            # As vLLM's Hermes parser has it, text after a tool call is not the answer's.
            if delta.get("content") and self.live is None:
                if self.text_block is None or self.open != self.text_block:
                    events += self._open({"type": "text", "text": ""})
                    self.text_block = self.open
                events.append(self._delta({"type": "text_delta", "text": delta["content"]}))
            for part in delta.get("tool_calls") or []:
                index = int(part.get("index", 0))
                function = part.get("function") or {}
                self.indices.add(index)
                if self.live is None:
                    self.live = index
                    events += self._open(self._tool_use(part.get("id"), function, index))
                if index == self.live and function.get("arguments"):
                    self.live_arguments += function["arguments"]
                    events.append(self._arguments(function["arguments"]))
        return events

    def _tool_use(self, call_id: Any, function: dict[str, Any], position: int) -> dict[str, Any]:
        return {
            "type": "tool_use",
            "id": str(call_id or f"toolu_{self.call_id}_{position}"),
            "name": str(function.get("name") or ""),
            "input": {},
        }

    def _arguments(self, partial_json: str) -> bytes:
        return self._delta({"type": "input_json_delta", "partial_json": partial_json})

    def _calls(self, answer: ChatAnswer) -> list[bytes]:
        """The tool calls as the recorded answer has them: what the live call's stream lacks,
        then every other call whole."""
        live = sorted(self.indices).index(self.live) if self.live is not None else None
        events: list[bytes] = []
        for position, call in enumerate(answer.tool_calls):
            function = call.get("function") or {}
            if position == live:
                arguments = str(function.get("arguments") or "")
                if arguments.startswith(self.live_arguments) and arguments != self.live_arguments:
                    events.append(self._arguments(arguments[len(self.live_arguments) :]))
                continue
            events += self._open(self._tool_use(call.get("id"), function, position))
            events.append(self._arguments(json.dumps(tool_input(call))))
        return events

    def done(self, response: dict[str, Any]) -> list[bytes]:
        answer = ChatAnswer(response)
        events = [] if self.started else self._start(response)
        events += self._calls(answer)
        events += self._close()
        stop_reason, stop_sequence = stop_of(self.request, answer)
        events.append(
            sse_event(
                "message_delta",
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                    "usage": {"output_tokens": answer.completion_tokens},
                },
            )
        )
        events.append(sse_event("message_stop", {"type": "message_stop"}))
        return events

    def error(self, message: str, code: str) -> bytes:
        return sse_event(
            "error", {"type": "error", "error": {"type": "api_error", "message": message}}
        )
