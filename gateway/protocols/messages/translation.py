"""The Anthropic Messages API (`/rollouts/{id}/v1/messages`, what the `anthropic` SDK and
Claude-Code-style harnesses speak through ANTHROPIC_BASE_URL) as a chat completion to the policy
server: `system`, text/image/tool_use/tool_result blocks and tools become chat messages and chat
tools; the answer becomes a Message (the `anthropic` package's own typed model), whole or as
Anthropic's SSE events. Errors take Anthropic's shape (`errors.anthropic_error_body`).
"""

from __future__ import annotations

import json
from typing import Any

from darl.gateway.errors import anthropic_error_body
from darl.gateway.protocols.messages.answer import message_of
from darl.gateway.protocols.messages.protocol import (
    CONTENT_BLOCKS,
    ImageBlockParam,
    MessagesRequest,
    RequestBase,
    TextBlockParam,
    ToolParam,
    ToolResultBlockParam,
    ToolUseBlockParam,
    UrlSourceParam,
)
from darl.gateway.protocols.messages.stream import MessagesStream
from darl.gateway.protocols.stream import ChatAnswer, StreamTranslation
from darl.gateway.protocols.translation import (
    Translation,
    assistant_message,
    chat_tool,
    chat_tool_call,
    parse_request,
    unsupported,
)
from darl.gateway.store.base import TrajectoryStore
from darl.workflows.rollout_token import TokenClaims


def _blocks(content: str | list[dict[str, Any]], where: str) -> list[Any]:
    if isinstance(content, str):
        return [TextBlockParam(type="text", text=content)]
    found = []
    for j, raw in enumerate(content):
        kind = str(raw.get("type"))
        model = CONTENT_BLOCKS.get(kind)
        if model is None:
            raise unsupported(f"content block type {kind!r} ({where}.content.{j})")
        found.append(parse_request(model, raw, "messages", f"{where}.content.{j}"))
    return found


def _image_part(image: ImageBlockParam) -> dict[str, Any]:
    source = image.source
    url = (
        source.url
        if isinstance(source, UrlSourceParam)
        else f"data:{source.media_type};base64,{source.data}"
    )
    return {"type": "image_url", "image_url": {"url": url}}


def _user_content(blocks: list[Any]) -> Any:
    """Text blocks as one string (what the policy server renders), else chat parts."""
    if all(isinstance(b, TextBlockParam) for b in blocks):
        return "\n".join(b.text for b in blocks)
    return [
        {"type": "text", "text": b.text} if isinstance(b, TextBlockParam) else _image_part(b)
        for b in blocks
    ]


def _tool_result_text(result: ToolResultBlockParam, where: str) -> str:
    content = result.content
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    else:
        blocks = _blocks(content, where)
        if not all(isinstance(b, TextBlockParam) for b in blocks):
            raise unsupported(f"a tool_result that is not text ({where})")
        text = "\n".join(b.text for b in blocks)
    # Chat tool messages have no error flag: the model reads it in the text.
    return f"Error: {text}" if result.is_error else text


def chat_messages(request: RequestBase) -> list[dict[str, Any]]:
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
            if not all(isinstance(b, TextBlockParam) for b in blocks):
                raise unsupported(f"blocks other than text in a system turn ({where})")
            messages.append({"role": "system", "content": "\n".join(b.text for b in blocks)})
            continue
        if message.role == "assistant":
            if any(isinstance(b, (ImageBlockParam, ToolResultBlockParam)) for b in blocks):
                raise unsupported(f"image or tool_result blocks in an assistant turn ({where})")
            text = "".join(b.text for b in blocks if isinstance(b, TextBlockParam))
            calls = [
                # The arguments as the policy server wrote them: canonical JSON.
                chat_tool_call(b.id, b.name, json.dumps(b.input, ensure_ascii=False))
                for b in blocks
                if isinstance(b, ToolUseBlockParam)
            ]
            messages.append(assistant_message(text, calls))
            continue
        if any(isinstance(b, ToolUseBlockParam) for b in blocks):
            raise unsupported(f"tool_use blocks in a user turn ({where})")
        # Tool results answer the assistant turn before them: in chat they come first.
        for j, block in enumerate(blocks):
            if isinstance(block, ToolResultBlockParam):
                messages.append(
                    {
                        "role": "tool",
                        "tool_call_id": block.tool_use_id,
                        "content": _tool_result_text(block, f"{where}.content.{j}"),
                    }
                )
        rest = [b for b in blocks if not isinstance(b, ToolResultBlockParam)]
        if rest:
            messages.append({"role": "user", "content": _user_content(rest)})
    return messages


def chat_tools(request: RequestBase) -> dict[str, Any]:
    """The chat request's `tools` and `tool_choice` fields for the request's tools."""
    fields: dict[str, Any] = {}
    tools = []
    for i, raw in enumerate(request.tools):
        kind = raw.get("type")
        if kind not in (None, "custom"):
            raise unsupported(f"tool type {kind!r} (tools.{i}): only custom (function) tools")
        tool = parse_request(ToolParam, raw, "messages", f"tools.{i}")
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
        super().__init__(chat, {})

    @classmethod
    async def of(
        cls, body: dict[str, Any], claims: TokenClaims, store: TrajectoryStore
    ) -> MessagesTranslation:
        """The request as a translation (a Messages request refers to no earlier call, so
        `claims` and `store` are not read)."""
        return cls(parse_request(MessagesRequest, body, "messages"))

    def answer(self, response: dict[str, Any], call_id: str) -> dict[str, Any]:
        message = message_of(self.request, ChatAnswer(response), call_id)
        return message.model_dump(mode="json", warnings=False)

    def streaming(self, call_id: str) -> StreamTranslation:
        return MessagesStream(self.request, call_id)

    def error_body(self, status: int, message: str, code: str) -> dict[str, Any]:
        return anthropic_error_body(status, message)
