"""OpenAI chat completions and completions as the gateway accepts them: the endpoints, the fields
DARL relies on (everything else passes through to the policy server untouched, so vLLM's own
extensions work), and the fields that change how a chat prompt renders."""

from __future__ import annotations

import math
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
    """Check the fields DARL relies on and the sampling parameters (`check_sampling`);
    returns whether the call streams."""
    if not SAMPLING_FIELDS.isdisjoint(body):
        check_sampling(endpoint, body)
    if _plainly_valid(endpoint, body):
        return bool(body.get("stream", False))
    schema = ChatCompletionRequest if endpoint == CHAT else CompletionRequest
    try:
        return schema.model_validate(body).stream
    except ValidationError as err:
        raise BadRequestError(
            f"invalid {endpoint} request: {describe_errors(err.errors())}"
        ) from err


# The sampling parameters a policy server takes, with the values vLLM accepts (its
# `SamplingParams` checks and its OpenAI protocol's bounds): (integer only, lowest, highest,
# whether the lowest itself is refused). A value outside them would make a policy server
# refuse the call, or fail it (the reference server's sampler took no seed over 2**64), and a
# server's failure is DARL's incident, retried and never trained: the agent could turn any
# attempt into one that does not count. So the gateway refuses them first, as the agent's
# error. None means the server's default.
INT64 = 2**63
SAMPLING_BOUNDS: dict[str, tuple[bool, float | None, float | None, bool]] = {
    "seed": (True, -INT64, INT64 - 1, False),
    "temperature": (False, 0.0, None, False),
    "top_p": (False, 0.0, 1.0, True),
    "top_k": (True, -1, None, False),
    "min_p": (False, 0.0, 1.0, False),
    "presence_penalty": (False, -2.0, 2.0, False),
    "frequency_penalty": (False, -2.0, 2.0, False),
    "repetition_penalty": (False, 0.0, None, True),
    "max_tokens": (True, 1, None, False),
    "max_completion_tokens": (True, 1, None, False),
    "min_tokens": (True, 0, None, False),
    "top_logprobs": (True, 0, 20, False),
}
SAMPLING_FIELDS = frozenset({*SAMPLING_BOUNDS, "logprobs"})


def check_sampling(endpoint: Endpoint, body: dict[str, Any]) -> None:
    """Refuse (BadRequestError, naming the field) a sampling parameter no policy server
    takes: the wrong type, a number out of its bounds, not finite."""
    for name in SAMPLING_FIELDS.intersection(body):
        value = body[name]
        if value is None:
            continue
        if name == "logprobs":
            # A chat call says whether (true or false); a completion how many (0 to 20).
            if endpoint == CHAT:
                if type(value) is not bool:
                    raise _bad_sampling(name, value, "true or false")
                continue
            bounds: tuple[bool, float | None, float | None, bool] = (True, 0, 20, False)
        else:
            bounds = SAMPLING_BOUNDS[name]
        integer, low, high, open_low = bounds
        kinds: tuple[type, ...] = (int,) if integer else (int, float)
        if type(value) not in kinds or (type(value) is float and not math.isfinite(value)):
            raise _bad_sampling(name, value, "an integer" if integer else "a finite number")
        below = low is not None and (value <= low if open_low else value < low)
        if below or (high is not None and value > high):
            raise _bad_sampling(name, value, _bounds(integer, low, high, open_low))


def _bounds(integer: bool, low: float | None, high: float | None, open_low: bool) -> str:
    shown = [
        f"{'over' if open_low else 'at least'} {low if integer else f'{low:g}'}"
        if low is not None
        else "",
        f"at most {high if integer else f'{high:g}'}" if high is not None else "",
    ]
    return " and ".join(part for part in shown if part)


def _bad_sampling(name: str, value: object, wanted: str) -> BadRequestError:
    shown = repr(value)
    shown = shown if len(shown) <= 40 else shown[:40] + "..."
    return BadRequestError(f"{name} must be {wanted}, not {shown}", param=name)
