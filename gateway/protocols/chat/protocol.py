"""OpenAI chat completions and completions as the gateway accepts them: the endpoints, the fields
DARL relies on (everything else passes through to the policy server untouched, so vLLM's own
extensions work), and the fields that change how a chat prompt renders."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from darl.gateway.errors import BadRequestError, describe_errors
from darl.gateway.protocols.chat.sent_messages import SentMessages

Endpoint = Literal["chat.completions", "completions"]
CHAT: Endpoint = "chat.completions"
COMPLETIONS: Endpoint = "completions"

UPSTREAM_PATHS: dict[Endpoint, str] = {
    CHAT: "/v1/chat/completions",
    "completions": "/v1/completions",
}
# The fields of a chat request that change how its prompt renders, which `/tokenize` takes too.
TEMPLATE_FIELDS = (
    "tools",
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "chat_template",
    "chat_template_kwargs",
)


class ChatCompletionRequest(BaseModel):
    """The fields of an OpenAI chat completion request the gateway relies on; the rest pass
    through to the policy server as sent."""

    model_config = ConfigDict(extra="allow")
    messages: list[dict[str, Any]] = Field(min_length=1)
    stream: bool = False
    n: int = Field(default=1, ge=1, le=16)


class CompletionRequest(BaseModel):
    """The fields of an OpenAI completion request the gateway relies on; the rest pass
    through."""

    model_config = ConfigDict(extra="allow")
    # One prompt per call: a trajectory is a sequence of calls, not a batch.
    prompt: str | list[int]
    stream: bool = False
    n: int = Field(default=1, ge=1, le=16)


def _plainly_valid(endpoint: Endpoint, body: dict[str, Any]) -> bool:
    """Whether the body's relied-on fields hold plain values the schema takes as they are:
    what agents send, checked without building a model of the whole body (a coding agent's
    conversation is thousands of messages' worth of dicts the model would copy). Anything
    else goes to the schema, which accepts or refuses it in its own words."""
    stream = body.get("stream", False)
    n = body.get("n", 1)
    if type(stream) is not bool or type(n) is not int or not 1 <= n <= 16:
        return False
    if endpoint == CHAT:
        messages = body.get("messages")
        if type(messages) is SentMessages:  # read only of a non-empty array of objects
            return True
        return type(messages) is list and bool(messages) and all(type(m) is dict for m in messages)
    prompt = body.get("prompt")
    return type(prompt) is str or (
        type(prompt) is list and all(type(token) is int for token in prompt)
    )


def validate_body(endpoint: Endpoint, body: dict[str, Any]) -> bool:
    """Check the fields DARL relies on; returns whether the call streams."""
    if _plainly_valid(endpoint, body):
        return bool(body.get("stream", False))
    schema = ChatCompletionRequest if endpoint == CHAT else CompletionRequest
    try:
        return schema.model_validate(body).stream
    except ValidationError as err:
        raise BadRequestError(
            f"invalid {endpoint} request: {describe_errors(err.errors())}"
        ) from err
