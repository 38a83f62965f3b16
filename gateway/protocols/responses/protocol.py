"""The OpenAI Responses API's requests as DARL accepts them: `ResponsesRequest` and the input
items, content parts and tools it may hold. Strict (an unknown field is a 400 naming it), so a
feature the gateway would silently drop is refused instead.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import ConfigDict, Field

from darl.gateway.protocols.translation import (
    Strict,
)

RESPONSE_ID = re.compile(r"^resp_([0-9a-f]{32})$")
LOGPROBS = "message.output_text.logprobs"


class FunctionToolParam(Strict):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunctionParam(Strict):
    type: Literal["function"]
    name: str


class TextFormatParam(Strict):
    type: Literal["text"]


class TextParam(Strict):
    format: TextFormatParam | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningParam(Strict):
    # Only "no reasoning" is honest for a policy without a reasoning mode.
    effort: Literal["none"] | None = None
    summary: None = None


class ResponsesRequest(Strict):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[FunctionToolParam] = Field(default_factory=list)
    tool_choice: Literal["auto", "none", "required"] | NamedFunctionParam | None = None
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
    text: TextParam | None = None
    reasoning: ReasoningParam | None = None
    truncation: Literal["disabled"] | None = None
    # Bookkeeping that changes nothing about the answer.
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None


# --- input items --------------------------------------------------------------------------


class TextPartParam(Strict):
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class ImagePartParam(Strict):
    type: Literal["input_image"]
    image_url: str
    detail: Literal["low", "high", "auto", "original"] | None = None


class RefusalPartParam(Strict):
    type: Literal["refusal"]
    refusal: str


class MessageItemParam(Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[dict[str, Any]]
    id: str | None = None
    status: str | None = None
    phase: str | None = None


class FunctionCallItemParam(Strict):
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


class FunctionCallOutputItemParam(Strict):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[dict[str, Any]]
    id: str | None = None
    status: str | None = None
    name: str | None = None
    caller: dict[str, Any] | None = None
    namespace: None = None


INPUT_ITEMS: dict[str, type[Strict]] = {
    "message": MessageItemParam,
    "function_call": FunctionCallItemParam,
    "function_call_output": FunctionCallOutputItemParam,
}
CONTENT_PARTS: dict[str, type[Strict]] = {
    "input_text": TextPartParam,
    "output_text": TextPartParam,
    "input_image": ImagePartParam,
    "refusal": RefusalPartParam,
}
