"""A prompt over the policy's context: told from a policy server's error answer in one place
(`is_context_overflow`), and said to the agent as its protocol's own API says it
(`context_length_exceeded`), so its client raises its context-window error (litellm's
`ContextWindowExceededError`, the SDKs' `BadRequestError` with OpenAI's code or Anthropic's
"prompt is too long") instead of retrying a request that can never fit."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from darl.gateway.errors import ContextLengthExceededError
from darl.gateway.protocols.chat.protocol import CHAT, COMPLETIONS

# What each OpenAI-shaped protocol calls the prompt: the `param` of its overflow error.
PROMPT_FIELDS = {CHAT: "messages", COMPLETIONS: "prompt", "responses": "input"}
ANTHROPIC = "messages"

# The `param` vLLM's renderer (0.32) sets on a prompt over the context: its token count
# (`input_tokens`), or its text, longer than the context could hold (`input_text`).
VLLM_OVERFLOW_PARAMS = frozenset({"input_tokens", "input_text"})
# OpenAI's code, which an OpenAI-compatible policy server may itself answer with.
OPENAI_OVERFLOW_CODE = "context_length_exceeded"
# How OpenAI, and vLLM releases that set no `param`, open the message of an overflow.
OVERFLOW_WORDS = "This model's maximum context length is"


def _error_object(body: bytes) -> dict[str, Any] | None:
    """The error of a policy server's answer: vLLM's and OpenAI's `{"error": {...}}`, or the
    flat `{"object": "error", ...}` of earlier vLLM releases."""
    try:
        parsed = json.loads(body)
    except ValueError:
        return None
    if not isinstance(parsed, dict):
        return None
    error = parsed.get("error")
    if isinstance(error, dict):
        return error
    return parsed if parsed.get("object") == "error" else None


def is_context_overflow(status: int, body: bytes) -> bool:
    """Whether a policy server's error answer says the prompt does not fit its context: a 400
    whose error names the prompt as the field at fault (vLLM), carries OpenAI's code, or, from
    a server that says neither, opens with OpenAI's words."""
    if status != 400:
        return False
    error = _error_object(body)
    if error is None:
        return False
    if error.get("code") == OPENAI_OVERFLOW_CODE or error.get("param") in VLLM_OVERFLOW_PARAMS:
        return True
    return str(error.get("message") or "").startswith(OVERFLOW_WORDS)


@dataclass(frozen=True)
class PromptSize:
    """A refused request measured by the policy server that refused it."""

    prompt_tokens: int
    max_model_len: int
    # The completion budget the request asked for (None: the server's default).
    max_tokens: int | None

    @property
    def prompt_alone_overflows(self) -> bool:
        return self.prompt_tokens > self.max_model_len


def context_length_exceeded(
    protocol: str, size: PromptSize | None, upstream_message: str
) -> ContextLengthExceededError:
    """The agent's error, in its protocol's words (`size` None: the policy server could not
    measure the prompt, whose own message then says it): OpenAI's for chat completions,
    completions and the Responses API, Anthropic's for the Messages API."""
    said = _in_anthropic_words(size) if protocol == ANTHROPIC else _in_openai_words(protocol, size)
    if said is None:
        prefix = "prompt is too long: " if protocol == ANTHROPIC else ""
        said = prefix + upstream_message
    return ContextLengthExceededError(said, param=PROMPT_FIELDS.get(protocol))


def _in_openai_words(protocol: str, size: PromptSize | None) -> str | None:
    field = PROMPT_FIELDS.get(protocol, "messages")
    if size is None:
        return None
    opening = f"{OVERFLOW_WORDS} {size.max_model_len} tokens. However, "
    if size.prompt_alone_overflows:
        return (
            f"{opening}your {field} resulted in {size.prompt_tokens} tokens. Please reduce "
            f"the length of the {field}."
        )
    if size.max_tokens is None:
        return None
    return (
        f"{opening}you requested {size.prompt_tokens + size.max_tokens} tokens "
        f"({size.prompt_tokens} in the {field}, {size.max_tokens} in the completion). "
        f"Please reduce the length of the {field} or completion."
    )


def _in_anthropic_words(size: PromptSize | None) -> str | None:
    if size is None:
        return None
    if size.prompt_alone_overflows:
        return f"prompt is too long: {size.prompt_tokens} tokens > {size.max_model_len} maximum"
    if size.max_tokens is None:
        return None
    return (
        f"input length and `max_tokens` exceed context limit: {size.prompt_tokens} + "
        f"{size.max_tokens} > {size.max_model_len}, decrease input length or `max_tokens` "
        "and try again"
    )
