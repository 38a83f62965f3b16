"""The Anthropic Messages API's requests as DARL accepts them: `MessagesRequest`,
`CountTokensRequest` and the blocks, tools and system texts they may hold. Strict (an unknown
field is a 400 naming it).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field

from darl.gateway.protocols.translation import (
    Strict,
)

CacheControl = dict[str, Any] | None  # cache_control: a caching hint, nothing to honour here


class ToolParam(Strict):
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: CacheControl = None
    strict: bool | None = None
    eager_input_streaming: bool | None = None


class ToolChoiceParam(Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingParam(Strict):
    type: Literal["disabled"]


class SystemTextParam(Strict):
    type: Literal["text"]
    text: str
    cache_control: CacheControl = None


class MessageParam(Strict):
    role: Literal["user", "assistant", "system"]
    content: str | list[dict[str, Any]]


class RequestBase(Strict):
    model: str | None = None
    messages: list[MessageParam] = Field(min_length=1)
    system: str | list[SystemTextParam] | None = None
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: ToolChoiceParam | None = None
    thinking: ThinkingParam | None = None


class MessagesRequest(RequestBase):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    # vLLM's extension (through the SDK's `extra_body`): a sampling seed, so a call can be
    # asked again and answered the same.
    seed: int | None = None
    stream: bool = False
    cache_control: CacheControl = None
    # Bookkeeping that changes nothing about the answer.
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    speed: str | None = None
    inference_geo: str | None = None


class CountTokensRequest(RequestBase):
    pass


# --- content blocks -----------------------------------------------------------------------


class TextBlockParam(Strict):
    type: Literal["text"]
    text: str
    cache_control: CacheControl = None
    citations: list[Any] | None = None


class Base64SourceParam(Strict):
    type: Literal["base64"]
    media_type: str
    data: str


class UrlSourceParam(Strict):
    type: Literal["url"]
    url: str


class ImageBlockParam(Strict):
    type: Literal["image"]
    source: Base64SourceParam | UrlSourceParam
    cache_control: CacheControl = None


class ToolUseBlockParam(Strict):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControl = None
    # Who called the tool (the model itself, for the calls DARL answers) and its toolset.
    caller: dict[str, Any] | None = None
    toolset_name: str | None = None


class ToolResultBlockParam(Strict):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[dict[str, Any]] | None = None
    is_error: bool | None = None
    cache_control: CacheControl = None
    toolset_name: str | None = None


CONTENT_BLOCKS: dict[str, type[Strict]] = {
    "text": TextBlockParam,
    "image": ImageBlockParam,
    "tool_use": ToolUseBlockParam,
    "tool_result": ToolResultBlockParam,
}


def tool_input(call: dict[str, Any]) -> dict[str, Any]:
    """A chat tool call's arguments as a tool_use block's input (an object; arguments that
    are not a JSON object give an empty input: the record keeps what the model wrote)."""
    try:
        value = json.loads((call.get("function") or {}).get("arguments") or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
