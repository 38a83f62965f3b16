"""The OpenAI Responses API (`/rollouts/{id}/v1/responses`, what the OpenAI Agents SDK speaks) as
a chat completion to the policy server: input items become chat messages, function tools chat
tools, and the answer a Response (the `openai` package's own typed model), whole or as the
Responses event stream.

`previous_response_id` names an earlier call of the same rollout: its conversation is read back
from the trajectory store (the record holds its chat messages and its answer), so the gateway
keeps no state of its own. As in OpenAI's API, the earlier call's `instructions` are not
carried over.
"""

from __future__ import annotations

import re
import time
from typing import Any, Literal

from openai.types.responses import (
    FunctionTool,
    Response,
    ResponseFunctionToolCall,
    ResponseOutputMessage,
    ResponseOutputText,
    ResponseTextConfig,
    ResponseUsage,
    ToolChoiceFunction,
)
from openai.types.responses.response import IncompleteDetails
from openai.types.responses.response_usage import InputTokensDetails, OutputTokensDetails
from openai.types.shared import ResponseFormatText
from pydantic import ConfigDict, Field

from darl.gateway.errors import bad_request
from darl.gateway.store import CallRecord, TrajectoryStore
from darl.gateway.translation import (
    ChatAnswer,
    StreamTranslation,
    Strict,
    Translation,
    assistant_message,
    chat_tool,
    chat_tool_call,
    parse_request,
    sse_event,
    unsupported,
)
from darl.workflows.rollout_token import TokenClaims

RESPONSE_ID = re.compile(r"^resp_([0-9a-f]{32})$")
LOGPROBS = "message.output_text.logprobs"


class _FunctionTool(Strict):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class _NamedFunction(Strict):
    type: Literal["function"]
    name: str


class _TextFormat(Strict):
    type: Literal["text"]


class _Text(Strict):
    format: _TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class _Reasoning(Strict):
    # Only "no reasoning" is honest for a policy without a reasoning mode.
    effort: Literal["none"] | None = None
    summary: None = None


class ResponsesRequest(Strict):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[_FunctionTool] = Field(default_factory=list)
    tool_choice: Literal["auto", "none", "required"] | _NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    # vLLM's extension (through the SDKs' `extra_body`): a sampling seed, so a call can be
    # asked again and answered the same.
    seed: int | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    stream_options: dict[str, bool] | None = None
    include: list[Literal["message.output_text.logprobs"]] = Field(default_factory=list)
    text: _Text | None = None
    reasoning: _Reasoning | None = None
    truncation: Literal["disabled"] | None = None
    # Bookkeeping that changes nothing about the answer.
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None


# --- input items --------------------------------------------------------------------------


class _TextPart(Strict):
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class _ImagePart(Strict):
    type: Literal["input_image"]
    image_url: str
    detail: Literal["low", "high", "auto", "original"] | None = None


class _RefusalPart(Strict):
    type: Literal["refusal"]
    refusal: str


class _Message(Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[dict[str, Any]]
    id: str | None = None
    status: str | None = None
    phase: str | None = None


class _FunctionCall(Strict):
    # The SDKs echo an answer's items back as they got them: `async` as `async_` too.
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None
    async_: bool | None = Field(default=None, alias="async")
    caller: dict[str, Any] | None = None
    # Namespaced (MCP) tools are not DARL's: only plain functions.
    namespace: None = None


class _FunctionCallOutput(Strict):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[dict[str, Any]]
    id: str | None = None
    status: str | None = None
    name: str | None = None
    caller: dict[str, Any] | None = None
    namespace: None = None


_ITEMS: dict[str, type[Strict]] = {
    "message": _Message,
    "function_call": _FunctionCall,
    "function_call_output": _FunctionCallOutput,
}
_PARTS: dict[str, type[Strict]] = {
    "input_text": _TextPart,
    "output_text": _TextPart,
    "input_image": _ImagePart,
    "refusal": _RefusalPart,
}


def _content(parts: str | list[dict[str, Any]], where: str, joiner: str) -> Any:
    """A message's content parts as chat content: one string when they are all text (the
    policy server renders exactly that), else OpenAI chat parts."""
    if isinstance(parts, str):
        return parts
    texts: list[str] = []
    chat_parts: list[dict[str, Any]] = []
    for j, raw in enumerate(parts):
        kind = str(raw.get("type"))
        model = _PARTS.get(kind)
        if model is None:
            raise unsupported(f"content part type {kind!r} ({where}.content.{j})")
        part = parse_request(model, raw, "responses", f"{where}.content.{j}")
        if isinstance(part, _ImagePart):
            chat_parts.append({"type": "image_url", "image_url": {"url": part.image_url}})
            continue
        text = part.refusal if isinstance(part, _RefusalPart) else part.text
        texts.append(text)
        chat_parts.append({"type": "text", "text": text})
    if len(chat_parts) == len(texts):
        return joiner.join(texts)
    return chat_parts


def chat_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Responses input items as chat messages: function calls join the assistant message
    before them (as the policy server answered them), their outputs become tool messages."""
    messages: list[dict[str, Any]] = []
    for i, raw in enumerate(items):
        kind = str(raw.get("type", "message"))
        model = _ITEMS.get(kind)
        if model is None:
            raise unsupported(f"input item type {kind!r} (input.{i})")
        item = parse_request(model, raw, "responses", f"input.{i}")
        if isinstance(item, _Message):
            if item.role == "assistant":
                messages.append(assistant_message(_content(item.content, f"input.{i}", ""), []))
            else:
                role = "system" if item.role == "developer" else item.role
                messages.append(
                    {"role": role, "content": _content(item.content, f"input.{i}", "\n")}
                )
        elif isinstance(item, _FunctionCall):
            call = chat_tool_call(item.call_id, item.name, item.arguments)
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append(assistant_message("", [call]))
        else:
            output = item.output
            text = output if isinstance(output, str) else _content(output, f"input.{i}", "\n")
            if not isinstance(text, str):
                raise unsupported(f"a function_call_output that is not text (input.{i})")
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": text})
    return messages


def answered_messages(record: CallRecord) -> list[dict[str, Any]]:
    """The conversation of an earlier call, its answer included, without its instructions."""
    messages = list(record.request.get("messages") or [])
    if record.exchange.get("instructions"):
        messages = messages[1:]
    answer = ChatAnswer(record.response)
    messages.append(assistant_message(answer.text, answer.tool_calls))
    return messages


async def _previous(
    store: TrajectoryStore, claims: TokenClaims, response_id: str
) -> list[dict[str, Any]]:
    match = RESPONSE_ID.match(response_id)
    found: list[CallRecord] = []
    if match is not None:
        try:
            found = await store.read(claims.rollout_id, None, call_ids=[match.group(1)])
        except KeyError:
            found = []
    if not found or found[0].protocol != ResponsesTranslation.protocol:
        raise bad_request(
            f"previous response {response_id[:80]!r} not found in this rollout",
            "previous_response_not_found",
        )
    if found and found[0].attempt != claims.attempt:
        # An attempt that replayed the call answered under the same id (rule 10): the
        # conversation is its own (the prompt it sent, which a normalizer let differ).
        mine = [
            r
            for r in await store.read(claims.rollout_id, claims.attempt)
            if r.exchange.get("answered_as") == found[0].call_id
        ]
        found = mine or found
    if not found[0].exchange.get("store", True):
        raise bad_request(
            f"previous response {response_id!r} was created with store=false",
            "previous_response_not_stored",
        )
    return answered_messages(found[0])


# --- the translation ----------------------------------------------------------------------


class ResponsesTranslation(Translation):
    protocol = "responses"

    def __init__(self, request: ResponsesRequest, history: list[dict[str, Any]]) -> None:
        self.request = request
        items = (
            [{"role": "user", "content": request.input}]
            if isinstance(request.input, str)
            else request.input
        )
        messages = [*history, *chat_messages(items)]
        if request.instructions is not None:
            messages.insert(0, {"role": "system", "content": request.instructions})
        if not messages:
            raise bad_request("invalid responses request: input: no messages")
        chat: dict[str, Any] = {"messages": messages}
        if request.tools:
            chat["tools"] = [
                chat_tool(t.name, t.description, t.parameters, t.strict) for t in request.tools
            ]
        choice = request.tool_choice
        if isinstance(choice, _NamedFunction):
            chat["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        elif choice is not None:
            chat["tool_choice"] = choice
        optional = {
            "parallel_tool_calls": request.parallel_tool_calls,
            "max_tokens": request.max_output_tokens,
            "temperature": request.temperature,
            "top_p": request.top_p,
            "top_logprobs": request.top_logprobs,
            "seed": request.seed,
        }
        chat.update({k: v for k, v in optional.items() if v is not None})
        if request.stream:
            chat["stream"] = True
        super().__init__(
            chat,
            request.stream,
            {"instructions": request.instructions is not None, "store": request.store},
        )

    @classmethod
    async def of(
        cls, body: dict[str, Any], claims: TokenClaims, store: TrajectoryStore
    ) -> ResponsesTranslation:
        request: ResponsesRequest = parse_request(ResponsesRequest, body, "responses")
        history = (
            await _previous(store, claims, request.previous_response_id)
            if request.previous_response_id
            else []
        )
        return cls(request, history)

    def response(
        self, answer: ChatAnswer | None, call_id: str, output: list[Any], status: str
    ) -> Response:
        request = self.request
        incomplete = answer is not None and answer.finish_reason == "length"
        choice = request.tool_choice
        return Response(
            id=f"resp_{call_id}",
            object="response",
            created_at=time.time(),
            model=answer.model if answer else (request.model or ""),
            status="incomplete" if incomplete else status,  # type: ignore[arg-type]
            incomplete_details=IncompleteDetails(reason="max_output_tokens")
            if incomplete
            else None,
            output=output,
            instructions=request.instructions,
            tools=[
                FunctionTool(
                    type="function",
                    name=t.name,
                    description=t.description,
                    parameters=t.parameters or {"type": "object"},
                    strict=t.strict,
                )
                for t in request.tools
            ],
            tool_choice=(
                ToolChoiceFunction(type="function", name=choice.name)
                if isinstance(choice, _NamedFunction)
                else (choice or "auto")
            ),
            parallel_tool_calls=request.parallel_tool_calls is not False,
            temperature=request.temperature,
            top_p=request.top_p,
            max_output_tokens=request.max_output_tokens,
            previous_response_id=request.previous_response_id,
            text=ResponseTextConfig(format=ResponseFormatText(type="text")),
            truncation="disabled",
            metadata=request.metadata or {},
            error=None,
            usage=(
                ResponseUsage(
                    input_tokens=answer.prompt_tokens,
                    input_tokens_details=InputTokensDetails(cached_tokens=0, cache_write_tokens=0),
                    output_tokens=answer.completion_tokens,
                    output_tokens_details=OutputTokensDetails(reasoning_tokens=0),
                    total_tokens=answer.prompt_tokens + answer.completion_tokens,
                )
                if answer is not None
                else None
            ),
        )

    def message_item(self, call_id: str, text: str, logprobs: list[Any]) -> ResponseOutputMessage:
        part = ResponseOutputText(
            type="output_text",
            text=text,
            annotations=[],
            logprobs=logprobs if LOGPROBS in self.request.include else None,
        )
        return ResponseOutputMessage(
            id=f"msg_{call_id}",
            type="message",
            role="assistant",
            status="completed",
            content=[part],
        )

    @staticmethod
    def call_item(call_id: str, index: int, call: dict[str, Any]) -> ResponseFunctionToolCall:
        function = call.get("function") or {}
        return ResponseFunctionToolCall(
            type="function_call",
            id=f"fc_{call_id}_{index}",
            call_id=str(call.get("id") or f"call_{call_id}_{index}"),
            name=str(function.get("name") or ""),
            arguments=str(function.get("arguments") or ""),
            status="completed",
        )

    def output(self, answer: ChatAnswer, call_id: str) -> list[Any]:
        items: list[Any] = []
        if answer.text or not answer.tool_calls:
            items.append(self.message_item(call_id, answer.text, answer.logprobs))
        items.extend(self.call_item(call_id, i, c) for i, c in enumerate(answer.tool_calls))
        return items

    def answer(self, response: dict[str, Any], call_id: str) -> dict[str, Any]:
        answer = ChatAnswer(response)
        built = self.response(answer, call_id, self.output(answer, call_id), "completed")
        return built.model_dump(mode="json", by_alias=True, warnings=False)

    def streaming(self, call_id: str) -> StreamTranslation:
        return _ResponsesStream(self, call_id)


class _ResponsesStream(StreamTranslation):
    """Chat chunks as the Responses event stream: `response.created`, then per output item
    `output_item.added`, its deltas and `.done`s, and `response.completed` once recorded."""

    def __init__(self, translation: ResponsesTranslation, call_id: str) -> None:
        self.t = translation
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
        skeleton = self.t.response(None, self.call_id, [], "in_progress")
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
        item = self.t.message_item(self.call_id, text, self.logprobs).model_dump(
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
                shown = logprobs if LOGPROBS in self.t.request.include else []
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
            item = self.t.call_item(
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
                    self.t.message_item(self.call_id, "".join(self.text), self.logprobs),
                )
            )
        for index, call in enumerate(answer.tool_calls):
            final = self.t.call_item(self.call_id, index, call)
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
        built = self.t.response(answer, self.call_id, [o for _, o in sorted(output)], "completed")
        kind = "response.incomplete" if built.status == "incomplete" else "response.completed"
        events.append(
            self._event(kind, response=built.model_dump(mode="json", by_alias=True, warnings=False))
        )
        return events

    def error(self, message: str, code: str) -> bytes:
        # The SDK's stream reader wants `response.created` before anything else.
        started = b"" if self.started else b"".join(self._start(self.t.request.model or ""))
        # The Responses API's error event, with the `error` object the openai SDK raises
        # an APIError from (else it yields the event and the stream just ends).
        failure = {"message": message, "type": "server_error", "code": code}
        return started + self._event("error", code=code, message=message, param=None, error=failure)
