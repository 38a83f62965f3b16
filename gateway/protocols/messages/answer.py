"""A chat answer in the Anthropic Messages API's terms, shared by the whole answer
(`translation`) and its stream (`stream`): the Message it becomes and why it stopped."""

from __future__ import annotations

from anthropic.types import Message, TextBlock, ToolUseBlock, Usage

from darl.gateway.protocols.messages.protocol import MessagesRequest, tool_input
from darl.gateway.protocols.stream import ChatAnswer


def stop_of(request: MessagesRequest, answer: ChatAnswer) -> tuple[str, str | None]:
    """Anthropic's (stop_reason, stop_sequence) for a chat finish reason."""
    if answer.tool_calls:
        return "tool_use", None
    if answer.finish_reason == "length":
        return "max_tokens", None
    stops = request.stop_sequences or []
    if isinstance(answer.stop_reason, str) and answer.stop_reason in stops:
        return "stop_sequence", answer.stop_reason
    return "end_turn", None


def message_of(request: MessagesRequest, answer: ChatAnswer, call_id: str) -> Message:
    """The whole answer as Anthropic's Message."""
    content: list[TextBlock | ToolUseBlock] = []
    if answer.text:
        content.append(TextBlock(type="text", text=answer.text))
    content.extend(
        ToolUseBlock(
            type="tool_use",
            id=str(c.get("id") or f"toolu_{call_id}_{i}"),
            name=str((c.get("function") or {}).get("name") or ""),
            input=tool_input(c),
        )
        for i, c in enumerate(answer.tool_calls)
    )
    stop_reason, stop_sequence = stop_of(request, answer)
    return Message(
        id=f"msg_{call_id}",
        type="message",
        role="assistant",
        model=answer.model or request.model or "",
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
