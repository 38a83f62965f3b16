"""The Anthropic Messages API (`/rollouts/{id}/v1/messages`, what the `anthropic` SDK and
Claude-Code-style harnesses speak through ANTHROPIC_BASE_URL) as a chat completion to the policy
server: `system`, text/image/tool_use/tool_result blocks and tools become chat messages and chat
tools; the answer becomes a Message (the `anthropic` package's own typed model), whole or as
Anthropic's SSE events. Errors take Anthropic's shape (`errors.anthropic_error_body`).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from anthropic.types import Message, TextBlock, ToolUseBlock, Usage
from pydantic import Field

from darl.gateway.errors import anthropic_error_body
from darl.gateway.store import TrajectoryStore
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

_CACHE = dict[str, Any] | None  # cache_control: a caching hint, nothing to honour here


class _Tool(Strict):
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: _CACHE = None
    strict: bool | None = None
    eager_input_streaming: bool | None = None


class _ToolChoice(Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class _Thinking(Strict):
    type: Literal["disabled"]


class _SystemText(Strict):
    type: Literal["text"]
    text: str
    cache_control: _CACHE = None


class _Message(Strict):
    role: Literal["user", "assistant", "system"]
    content: str | list[dict[str, Any]]


class _Common(Strict):
    model: str | None = None
    messages: list[_Message] = Field(min_length=1)
    system: str | list[_SystemText] | None = None
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: _ToolChoice | None = None
    thinking: _Thinking | None = None


class MessagesRequest(_Common):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    # vLLM's extension (through the SDK's `extra_body`): a sampling seed, so a call can be
    # asked again and answered the same.
    seed: int | None = None
    stream: bool = False
    cache_control: _CACHE = None
    # Bookkeeping that changes nothing about the answer.
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    speed: str | None = None
    inference_geo: str | None = None


class CountTokensRequest(_Common):
    pass


# --- content blocks -----------------------------------------------------------------------


class _Text(Strict):
    type: Literal["text"]
    text: str
    cache_control: _CACHE = None
    citations: list[Any] | None = None


class _Base64Source(Strict):
    type: Literal["base64"]
    media_type: str
    data: str


class _UrlSource(Strict):
    type: Literal["url"]
    url: str


class _Image(Strict):
    type: Literal["image"]
    source: _Base64Source | _UrlSource
    cache_control: _CACHE = None


class _ToolUse(Strict):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: _CACHE = None
    # Who called the tool (the model itself, for the calls DARL answers) and its toolset.
    caller: dict[str, Any] | None = None
    toolset_name: str | None = None


class _ToolResult(Strict):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[dict[str, Any]] | None = None
    is_error: bool | None = None
    cache_control: _CACHE = None
    toolset_name: str | None = None


_BLOCKS: dict[str, type[Strict]] = {
    "text": _Text,
    "image": _Image,
    "tool_use": _ToolUse,
    "tool_result": _ToolResult,
}


def _blocks(content: str | list[dict[str, Any]], where: str) -> list[Any]:
    if isinstance(content, str):
        return [_Text(type="text", text=content)]
    found = []
    for j, raw in enumerate(content):
        kind = str(raw.get("type"))
        model = _BLOCKS.get(kind)
        if model is None:
            raise unsupported(f"content block type {kind!r} ({where}.content.{j})")
        found.append(parse_request(model, raw, "messages", f"{where}.content.{j}"))
    return found


def _image_part(image: _Image) -> dict[str, Any]:
    source = image.source
    url = (
        source.url
        if isinstance(source, _UrlSource)
        else f"data:{source.media_type};base64,{source.data}"
    )
    return {"type": "image_url", "image_url": {"url": url}}


def _user_content(blocks: list[Any]) -> Any:
    """Text blocks as one string (what the policy server renders), else chat parts."""
    if all(isinstance(b, _Text) for b in blocks):
        return "\n".join(b.text for b in blocks)
    return [
        {"type": "text", "text": b.text} if isinstance(b, _Text) else _image_part(b) for b in blocks
    ]


def _tool_result_text(result: _ToolResult, where: str) -> str:
    content = result.content
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    else:
        blocks = _blocks(content, where)
        if not all(isinstance(b, _Text) for b in blocks):
            raise unsupported(f"a tool_result that is not text ({where})")
        text = "\n".join(b.text for b in blocks)
    # Chat tool messages have no error flag: the model reads it in the text.
    return f"Error: {text}" if result.is_error else text


def chat_messages(request: _Common) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if request.system is not None:
        system = (
            request.system
            if isinstance(request.system, str)
            else "\n".join(b.text for b in request.system)
        )
        messages.append({"role": "system", "content": system})
    for i, message in enumerate(request.messages):
        where = f"messages.{i}"
        blocks = _blocks(message.content, where)
        if message.role == "system":
            if not all(isinstance(b, _Text) for b in blocks):
                raise unsupported(f"blocks other than text in a system turn ({where})")
            messages.append({"role": "system", "content": "\n".join(b.text for b in blocks)})
            continue
        if message.role == "assistant":
            if any(isinstance(b, (_Image, _ToolResult)) for b in blocks):
                raise unsupported(f"image or tool_result blocks in an assistant turn ({where})")
            text = "".join(b.text for b in blocks if isinstance(b, _Text))
            calls = [
                # The arguments as the policy server wrote them: canonical JSON.
                chat_tool_call(b.id, b.name, json.dumps(b.input, ensure_ascii=False))
                for b in blocks
                if isinstance(b, _ToolUse)
            ]
            messages.append(assistant_message(text, calls))
            continue
        if any(isinstance(b, _ToolUse) for b in blocks):
            raise unsupported(f"tool_use blocks in a user turn ({where})")
        # Tool results answer the assistant turn before them: in chat they come first.
        for j, block in enumerate(blocks):
            if isinstance(block, _ToolResult):
                messages.append(
                    {
                        "role": "tool",
                        "tool_call_id": block.tool_use_id,
                        "content": _tool_result_text(block, f"{where}.content.{j}"),
                    }
                )
        rest = [b for b in blocks if not isinstance(b, _ToolResult)]
        if rest:
            messages.append({"role": "user", "content": _user_content(rest)})
    return messages


def chat_tools(request: _Common) -> dict[str, Any]:
    """The chat request's `tools` and `tool_choice` fields for the request's tools."""
    fields: dict[str, Any] = {}
    tools = []
    for i, raw in enumerate(request.tools):
        kind = raw.get("type")
        if kind not in (None, "custom"):
            raise unsupported(f"tool type {kind!r} (tools.{i}): only custom (function) tools")
        tool = parse_request(_Tool, raw, "messages", f"tools.{i}")
        tools.append(chat_tool(tool.name, tool.description, tool.input_schema, tool.strict))
    if tools:
        fields["tools"] = tools
    choice = request.tool_choice
    if choice is not None:
        if choice.type == "tool":
            if not choice.name:
                raise unsupported("tool_choice of type 'tool' without a name")
            fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        else:
            fields["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
        if choice.disable_parallel_tool_use:
            fields["parallel_tool_calls"] = False
    return fields


def _input(call: dict[str, Any]) -> dict[str, Any]:
    """A chat tool call's arguments as a tool_use block's input (an object; arguments that
    are not a JSON object give an empty input: the record keeps what the model wrote)."""
    try:
        value = json.loads((call.get("function") or {}).get("arguments") or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


class MessagesTranslation(Translation):
    protocol = "messages"

    def __init__(self, request: MessagesRequest) -> None:
        self.request = request
        chat: dict[str, Any] = {
            "messages": chat_messages(request),
            "max_tokens": request.max_tokens,
            **chat_tools(request),
        }
        optional = {
            "stop": request.stop_sequences,
            "temperature": request.temperature,
            "top_p": request.top_p,
            "top_k": request.top_k,
            "seed": request.seed,
        }
        chat.update({k: v for k, v in optional.items() if v is not None})
        if request.stream:
            chat["stream"] = True
        super().__init__(chat, request.stream, {})

    @classmethod
    async def of(
        cls, body: dict[str, Any], claims: TokenClaims, store: TrajectoryStore
    ) -> MessagesTranslation:
        """The request as a translation (a Messages request refers to no earlier call, so
        `claims` and `store` are not read)."""
        return cls(parse_request(MessagesRequest, body, "messages"))

    def stop(self, answer: ChatAnswer) -> tuple[str, str | None]:
        """Anthropic's (stop_reason, stop_sequence) for a chat finish reason."""
        if answer.tool_calls:
            return "tool_use", None
        if answer.finish_reason == "length":
            return "max_tokens", None
        stops = self.request.stop_sequences or []
        if isinstance(answer.stop_reason, str) and answer.stop_reason in stops:
            return "stop_sequence", answer.stop_reason
        return "end_turn", None

    def message(self, answer: ChatAnswer, call_id: str) -> Message:
        content: list[TextBlock | ToolUseBlock] = []
        if answer.text:
            content.append(TextBlock(type="text", text=answer.text))
        content.extend(
            ToolUseBlock(
                type="tool_use",
                id=str(c.get("id") or f"toolu_{call_id}_{i}"),
                name=str((c.get("function") or {}).get("name") or ""),
                input=_input(c),
            )
            for i, c in enumerate(answer.tool_calls)
        )
        stop_reason, stop_sequence = self.stop(answer)
        return Message(
            id=f"msg_{call_id}",
            type="message",
            role="assistant",
            model=answer.model or self.request.model or "",
            content=list(content),
            stop_reason=stop_reason,  # type: ignore[arg-type]
            stop_sequence=stop_sequence,
            usage=Usage(
                input_tokens=answer.prompt_tokens,
                output_tokens=answer.completion_tokens,
                cache_creation_input_tokens=0,
                cache_read_input_tokens=0,
            ),
        )

    def answer(self, response: dict[str, Any], call_id: str) -> dict[str, Any]:
        return self.message(ChatAnswer(response), call_id).model_dump(mode="json", warnings=False)

    def streaming(self, call_id: str) -> StreamTranslation:
        return _MessagesStream(self, call_id)

    def error_body(self, status: int, message: str, code: str) -> dict[str, Any]:
        return anthropic_error_body(status, message)


class _MessagesStream(StreamTranslation):
    """Chat chunks as Anthropic's events: `message_start`, per block `content_block_start`,
    its deltas and `content_block_stop`, then `message_delta` and `message_stop` once
    recorded."""

    def __init__(self, translation: MessagesTranslation, call_id: str) -> None:
        self.t = translation
        self.call_id = call_id
        self.started = False
        self.blocks = 0
        self.open: int | None = None  # the block index deltas go to
        self.text_block: int | None = None
        self.calls: dict[int, int] = {}  # chat tool call index -> block index

    def _start(self, chunk: dict[str, Any]) -> list[bytes]:
        self.started = True
        message: dict[str, Any] = {
            "id": f"msg_{self.call_id}",
            "type": "message",
            "role": "assistant",
            "content": [],
            "model": str(chunk.get("model") or self.t.request.model or ""),
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
            if delta.get("content") and not self.calls:
                if self.text_block is None or self.open != self.text_block:
                    events += self._open({"type": "text", "text": ""})
                    self.text_block = self.open
                events.append(self._delta({"type": "text_delta", "text": delta["content"]}))
            for part in delta.get("tool_calls") or []:
                index = int(part.get("index", 0))
                function = part.get("function") or {}
                if index not in self.calls:
                    block = {
                        "type": "tool_use",
                        "id": str(part.get("id") or f"toolu_{self.call_id}_{index}"),
                        "name": str(function.get("name") or ""),
                        "input": {},
                    }
                    events += self._open(block)
                    self.calls[index] = self.blocks - 1
                if function.get("arguments") and self.open == self.calls[index]:
                    delta_json = {"type": "input_json_delta", "partial_json": function["arguments"]}
                    events.append(self._delta(delta_json))
        return events

    def done(self, response: dict[str, Any]) -> list[bytes]:
        answer = ChatAnswer(response)
        events = [] if self.started else self._start(response)
        events += self._close()
        stop_reason, stop_sequence = self.t.stop(answer)
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
