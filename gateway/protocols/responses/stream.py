"""Chat completion chunks from the policy server as the Responses API's event stream
(`ResponsesStream`).
"""

from __future__ import annotations

from typing import Any

from darl.gateway.protocols.responses.answer import call_item, message_item, response_of
from darl.gateway.protocols.responses.protocol import LOGPROBS, ResponsesRequest
from darl.gateway.protocols.stream import ChatAnswer, StreamTranslation, sse_event


class ResponsesStream(StreamTranslation):
    """Chat chunks as the Responses event stream: `response.created`, then per output item
    `output_item.added`, its deltas and `.done`s, and `response.completed` once recorded."""

    def __init__(self, request: ResponsesRequest, call_id: str) -> None:
        self.request = request
        self.call_id = call_id
        self.sequence = 0
        self.started = False
        self.items = 0
        self.text: list[str] = []
        self.logprobs: list[Any] = []
        self.message_index: int | None = None
        self.message_open = False
        # chat tool call index -> (output index, item, accumulated arguments)
        self.calls: dict[int, tuple[int, dict[str, Any], list[str]]] = {}

    def _event(self, kind: str, /, **data: Any) -> bytes:
        event = sse_event(kind, {"type": kind, "sequence_number": self.sequence, **data})
        self.sequence += 1
        return event

    def _start(self, model: str) -> list[bytes]:
        self.started = True
        skeleton = response_of(self.request, None, self.call_id, [], "in_progress")
        skeleton.model = model or skeleton.model
        body = skeleton.model_dump(mode="json", by_alias=True, warnings=False)
        return [
            self._event("response.created", response=body),
            self._event("response.in_progress", response=body),
        ]

    def _open_message(self) -> list[bytes]:
        self.message_index, self.message_open = self.items, True
        self.items += 1
        item = {
            "id": f"msg_{self.call_id}",
            "type": "message",
            "status": "in_progress",
            "role": "assistant",
            "content": [],
        }
        part = {"type": "output_text", "text": "", "annotations": []}
        ids = {"item_id": item["id"], "output_index": self.message_index}
        return [
            self._event("response.output_item.added", output_index=self.message_index, item=item),
            self._event("response.content_part.added", **ids, content_index=0, part=part),
        ]

    def _close_message(self) -> list[bytes]:
        self.message_open = False
        text = "".join(self.text)
        item = message_item(self.request, self.call_id, text, self.logprobs).model_dump(
            mode="json", by_alias=True, warnings=False
        )
        ids = {"item_id": item["id"], "output_index": self.message_index}
        return [
            self._event(
                "response.output_text.done", **ids, content_index=0, text=text, logprobs=[]
            ),
            self._event(
                "response.content_part.done", **ids, content_index=0, part=item["content"][0]
            ),
            self._event("response.output_item.done", output_index=self.message_index, item=item),
        ]

    def chunk(self, chunk: dict[str, Any]) -> list[bytes]:
        events = [] if self.started else self._start(str(chunk.get("model") or ""))
        for choice in chunk.get("choices") or []:
            if choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            content = delta.get("content")
            logprobs = (choice.get("logprobs") or {}).get("content") or []
            # As vLLM's Hermes parser has it, text after a tool call is not the answer's.
            if content and not self.calls:
                if self.message_index is None:
                    events += self._open_message()
                self.text.append(content)
                self.logprobs.extend(logprobs)
                shown = logprobs if LOGPROBS in self.request.include else []
                events.append(
                    self._event(
                        "response.output_text.delta",
                        item_id=f"msg_{self.call_id}",
                        output_index=self.message_index,
                        content_index=0,
                        delta=content,
                        logprobs=shown,
                    )
                )
            for part in delta.get("tool_calls") or []:
                events += self._tool_call_delta(part)
        return events

    def _tool_call_delta(self, part: dict[str, Any]) -> list[bytes]:
        events: list[bytes] = []
        index = int(part.get("index", 0))
        function = part.get("function") or {}
        if index not in self.calls:
            if self.message_open:
                events += self._close_message()
            item = call_item(
                self.call_id, index, {"id": part.get("id"), "function": function}
            ).model_dump(mode="json", by_alias=True, warnings=False)
            item.update(arguments="", status="in_progress")
            self.calls[index] = (self.items, item, [])
            self.items += 1
            events.append(
                self._event("response.output_item.added", output_index=self.items - 1, item=item)
            )
        output_index, item, arguments = self.calls[index]
        if function.get("arguments"):
            arguments.append(function["arguments"])
            events.append(
                self._event(
                    "response.function_call_arguments.delta",
                    item_id=item["id"],
                    output_index=output_index,
                    delta=function["arguments"],
                )
            )
        return events

    def done(self, response: dict[str, Any]) -> list[bytes]:
        answer = ChatAnswer(response)
        events = [] if self.started else self._start(answer.model)
        if self.message_index is None and not answer.tool_calls:
            events += self._open_message()  # an empty answer is one empty message
        if self.message_open:
            events += self._close_message()
        output: list[tuple[int, Any]] = []
        if self.message_index is not None:
            output.append(
                (
                    self.message_index,
                    message_item(self.request, self.call_id, "".join(self.text), self.logprobs),
                )
            )
        for index, call in enumerate(answer.tool_calls):
            final = call_item(self.call_id, index, call)
            opened = self.calls.get(index)
            if opened is None:  # a call the stream never showed: show it whole
                opened = (self.items, {}, [])
                self.items += 1
                events.append(
                    self._event(
                        "response.output_item.added",
                        output_index=opened[0],
                        item={
                            **final.model_dump(mode="json", by_alias=True, warnings=False),
                            "status": "in_progress",
                        },
                    )
                )
            ids = {"item_id": final.id, "output_index": opened[0]}
            events.append(
                self._event(
                    "response.function_call_arguments.done",
                    **ids,
                    name=final.name,
                    arguments=final.arguments,
                )
            )
            events.append(
                self._event(
                    "response.output_item.done",
                    output_index=opened[0],
                    item=final.model_dump(mode="json", by_alias=True, warnings=False),
                )
            )
            output.append((opened[0], final))
        built = response_of(
            self.request, answer, self.call_id, [o for _, o in sorted(output)], "completed"
        )
        kind = "response.incomplete" if built.status == "incomplete" else "response.completed"
        events.append(
            self._event(kind, response=built.model_dump(mode="json", by_alias=True, warnings=False))
        )
        return events

    def error(self, message: str, code: str) -> bytes:
        # The SDK's stream reader wants `response.created` before anything else.
        started = b"" if self.started else b"".join(self._start(self.request.model or ""))
        # The Responses API's error event, with the `error` object the openai SDK raises
        # an APIError from (else it yields the event and the stream just ends).
        failure = {"message": message, "type": "server_error", "code": code}
        return started + self._event("error", code=code, message=message, param=None, error=failure)
