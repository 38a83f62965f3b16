"""A chat answer in the Responses API's terms, shared by the whole answer (`translation`) and
its stream (`stream`): the Response it becomes and its output items."""

from __future__ import annotations

import time
from typing import Any

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

from darl.gateway.protocols.responses.protocol import LOGPROBS, NamedFunctionParam, ResponsesRequest
from darl.gateway.protocols.stream import ChatAnswer


def response_of(
    request: ResponsesRequest,
    answer: ChatAnswer | None,
    call_id: str,
    output: list[Any],
    status: str,
) -> Response:
    """The Response of the call `call_id`, with its `output` items; without an answer yet
    (None), the skeleton a stream starts with."""
    incomplete = answer is not None and answer.finish_reason == "length"
    choice = request.tool_choice
    return Response(
        id=f"resp_{call_id}",
        object="response",
        created_at=time.time(),
        model=answer.model if answer else (request.model or ""),
        status="incomplete" if incomplete else status,  # type: ignore[arg-type]
        incomplete_details=IncompleteDetails(reason="max_output_tokens") if incomplete else None,
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
            if isinstance(choice, NamedFunctionParam)
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


def message_item(
    request: ResponsesRequest, call_id: str, text: str, logprobs: list[Any]
) -> ResponseOutputMessage:
    """The answer's text as an output message (its logprobs if the request included them)."""
    part = ResponseOutputText(
        type="output_text",
        text=text,
        annotations=[],
        logprobs=logprobs if LOGPROBS in request.include else None,
    )
    return ResponseOutputMessage(
        id=f"msg_{call_id}",
        type="message",
        role="assistant",
        status="completed",
        content=[part],
    )


def call_item(call_id: str, index: int, call: dict[str, Any]) -> ResponseFunctionToolCall:
    """A chat tool call of the answer as a function call item."""
    function = call.get("function") or {}
    return ResponseFunctionToolCall(
        type="function_call",
        id=f"fc_{call_id}_{index}",
        call_id=str(call.get("id") or f"call_{call_id}_{index}"),
        name=str(function.get("name") or ""),
        arguments=str(function.get("arguments") or ""),
        status="completed",
    )


def output_items(request: ResponsesRequest, answer: ChatAnswer, call_id: str) -> list[Any]:
    """The whole answer's output items: its message (one, empty, when it has no tool call),
    then its function calls."""
    items: list[Any] = []
    if answer.text or not answer.tool_calls:
        items.append(message_item(request, call_id, answer.text, answer.logprobs))
    items.extend(call_item(call_id, i, c) for i, c in enumerate(answer.tool_calls))
    return items
