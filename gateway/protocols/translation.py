"""Agent protocols other than chat completions (the Responses API, the Anthropic Messages API)
reach the policy server as chat completions: a `Translation` turns the agent's request into
the chat request the gateway forwards (and captures, token ids and logprobs forced as for any
chat call), and the policy server's answer back into the agent's protocol, whole or streamed
(each protocol's `StreamTranslation`, see `stream`).

The trainer never learns which protocol an agent spoke: the record is a chat completion call,
with its protocol noted (`CallRecord.protocol`).
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, ValidationError

from darl.gateway.errors import (
    BadRequestError,
    UnsupportedError,
    describe_errors,
    error_body,
)
from darl.gateway.protocols.stream import StreamTranslation
from darl.gateway.store.base import TrajectoryStore
from darl.workflows.rollout_token import TokenClaims


class Strict(BaseModel):
    """A request model that names the fields DARL does not support instead of ignoring them."""

    model_config = ConfigDict(extra="forbid")


def parse_request(model: type[Strict], body: dict[str, Any], protocol: str, at: str = "") -> Any:
    """`body` as `model`, or a 400 naming what is wrong where (`at`: the body's place in the
    request, e.g. `input.3`)."""
    try:
        return model.model_validate(body)
    except ValidationError as err:
        said = unsupported_or(err.errors(), at)
        raise BadRequestError(f"invalid {protocol} request: {said}") from err


def unsupported_or(errors: Sequence[Any], at: str = "") -> str:
    """Pydantic's errors, the unknown fields said as unsupported: `unsupported field(s):
    input.0.foo` before the rest."""
    prefix = [at] if at else []
    extra = [
        ".".join(map(str, [*prefix, *e["loc"]])) for e in errors if e["type"] == "extra_forbidden"
    ]
    other = [{**e, "loc": (*prefix, *e["loc"])} for e in errors if e["type"] != "extra_forbidden"]
    said = [f"unsupported field(s): {', '.join(extra)}"] if extra else []
    if other:
        said.append(describe_errors(other))
    return "; ".join(said)


def unsupported(what: str) -> UnsupportedError:
    return UnsupportedError(f"unsupported: {what}")


def chat_tool(
    name: str,
    description: str | None,
    parameters: dict[str, Any] | None,
    strict: bool | None = None,
) -> dict[str, Any]:
    """A function tool as chat completions take it (`strict`: vLLM then holds the arguments
    to the schema when it constrains a forced call)."""
    function: dict[str, Any] = {"name": name, "parameters": parameters or {"type": "object"}}
    if description:
        function["description"] = description
    if strict is not None:
        function["strict"] = strict
    return {"type": "function", "function": function}


def assistant_message(text: str, tool_calls: list[dict[str, Any]]) -> dict[str, Any]:
    """A chat assistant message as the policy server's template renders it back: content
    always a string (the answer's own text, empty beside tool calls)."""
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return message


def chat_tool_call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def upstream_error_message(body: bytes) -> str:
    """The message of a policy server's error answer (OpenAI's shape), else its text."""
    try:
        parsed = json.loads(body)
    except ValueError:
        return body.decode("utf-8", "replace")[:2000]
    if isinstance(parsed, dict):
        error = parsed.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        if isinstance(error, str):
            return error
        if parsed.get("message"):
            return str(parsed["message"])
    return json.dumps(parsed)[:2000]


class Translation(ABC):
    """One agent request in another protocol, and the way back."""

    protocol: ClassVar[str]

    def __init__(self, chat: dict[str, Any], exchange: dict[str, Any]) -> None:
        # The chat completion request forwarded to the policy server.
        self.chat = chat
        # What the record keeps of the protocol: the ids it answered under, and what a later
        # request that refers to this one (`previous_response_id`) needs.
        self.exchange = exchange

    @classmethod
    @abstractmethod
    async def of(
        cls, body: dict[str, Any], claims: TokenClaims, store: TrajectoryStore
    ) -> Translation:
        """The agent's request as a translation, or a 400 saying what is wrong with it;
        `store` holds the rollout's earlier calls a request may refer to."""

    @abstractmethod
    def answer(self, response: dict[str, Any], call_id: str) -> dict[str, Any]:
        """The whole answer in the agent's protocol."""

    @abstractmethod
    def streaming(self, call_id: str) -> StreamTranslation:
        """A translator for the answer's stream."""

    def error_body(self, status: int, message: str, code: str) -> dict[str, Any]:
        """A policy server's error answer in the agent's protocol (OpenAI's shape unless the
        protocol has its own)."""
        kind = "server_error" if status >= 500 else "invalid_request_error"
        return error_body(message, kind, code)


def protocol_of(endpoint: str, translation: Translation | type[Translation] | None) -> str:
    """The protocol a call was spoken in, as the record and the metrics name it: the
    translation's (`responses`, `messages`), else the endpoint's own."""
    return translation.protocol if translation is not None else endpoint
