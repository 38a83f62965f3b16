"""How the gateway tells a prompt over the context from a policy server's other refusals (by
the error's status, `param` and code; OpenAI's opening words only from a server that says
neither), and the words it then says it in, per protocol. The answers of the reference server
and a real vLLM 0.32 are checked end to end in tests/integration/test_context_overflow.py."""

from __future__ import annotations

import json
from typing import Any

import pytest

from darl.gateway.errors import ContextLengthExceededError
from darl.gateway.protocols.overflow import (
    PromptSize,
    context_length_exceeded,
    is_context_overflow,
)

VLLM_032 = {
    "error": {
        "message": "This model's maximum context length is 2048 tokens. However, your prompt "
        "contains at least 2049 input tokens, which exceeds this limit even without any output "
        "tokens. Please reduce the length of the input prompt. (parameter=input_tokens, "
        "value=2049)",
        "type": "BadRequestError",
        "param": "input_tokens",
        "code": 400,
    }
}
VLLM_032_TEXT = {
    "error": {
        "message": "This model's maximum context length is 2048 tokens. However, your prompt "
        "contains 9000 characters (more than 8192 characters, which is the upper bound for "
        "2048 input tokens). Please reduce the length of the input prompt.",
        "type": "BadRequestError",
        "param": "input_text",
        "code": 400,
    }
}
# The flat body and words of vLLM releases before its renderer.
VLLM_EARLIER = {
    "object": "error",
    "message": "This model's maximum context length is 2048 tokens. However, you requested "
    "2100 tokens (2036 in the messages, 64 in the completion). Please reduce the length of the "
    "messages or completion.",
    "type": "BadRequestError",
    "param": None,
    "code": 400,
}
OPENAI = {
    "error": {
        "message": "Your input exceeds the context window of this model.",
        "type": "invalid_request_error",
        "param": "input",
        "code": "context_length_exceeded",
    }
}
BUDGET = {
    "error": {
        "message": "max_tokens=5000 cannot be greater than max_model_len=2048. Please request "
        "fewer output tokens. (parameter=max_tokens, value=5000)",
        "type": "BadRequestError",
        "param": "max_tokens",
        "code": 400,
    }
}


@pytest.mark.parametrize(
    ("status", "body", "overflow"),
    [
        (400, VLLM_032, True),
        (400, VLLM_032_TEXT, True),
        (400, VLLM_EARLIER, True),
        (400, OPENAI, True),
        (400, BUDGET, False),
        (400, {"error": {"message": "token ids must lie in [0, 101)", "param": None}}, False),
        (500, VLLM_032, False),
        (400, "This model's maximum context length is 2048 tokens.", False),
    ],
)
def test_an_overflow_is_told_by_the_errors_fields(
    status: int, body: dict[str, Any] | str, overflow: bool
) -> None:
    assert is_context_overflow(status, json.dumps(body).encode()) is overflow


PROMPT_OVER = PromptSize(prompt_tokens=3019, max_model_len=2048, max_tokens=64)
PROMPT_AND_BUDGET_OVER = PromptSize(prompt_tokens=2036, max_model_len=2048, max_tokens=64)


@pytest.mark.parametrize(
    ("protocol", "size", "said", "param"),
    [
        (
            "chat.completions",
            PROMPT_OVER,
            "This model's maximum context length is 2048 tokens. However, your messages "
            "resulted in 3019 tokens. Please reduce the length of the messages.",
            "messages",
        ),
        (
            "responses",
            PROMPT_OVER,
            "This model's maximum context length is 2048 tokens. However, your input resulted "
            "in 3019 tokens. Please reduce the length of the input.",
            "input",
        ),
        (
            "completions",
            PROMPT_AND_BUDGET_OVER,
            "This model's maximum context length is 2048 tokens. However, you requested 2100 "
            "tokens (2036 in the prompt, 64 in the completion). Please reduce the length of "
            "the prompt or completion.",
            "prompt",
        ),
        ("messages", PROMPT_OVER, "prompt is too long: 3019 tokens > 2048 maximum", None),
        (
            "messages",
            PROMPT_AND_BUDGET_OVER,
            "input length and `max_tokens` exceed context limit: 2036 + 64 > 2048, decrease "
            "input length or `max_tokens` and try again",
            None,
        ),
        # Unmeasured: the policy server's own words, which say it.
        ("chat.completions", None, "upstream words", "messages"),
        ("messages", None, "prompt is too long: upstream words", None),
    ],
)
def test_each_protocol_says_it_in_its_own_words(
    protocol: str, size: PromptSize | None, said: str, param: str | None
) -> None:
    error = context_length_exceeded(protocol, size, "upstream words")
    assert isinstance(error, ContextLengthExceededError)
    assert (error.status, error.code, error.message, error.param) == (
        400,
        "context_length_exceeded",
        said,
        param,
    )
