"""A prompt over the policy's context, whatever protocol the agent speaks and whatever policy
server answers it. The reference server refuses it as a real vLLM 0.32 does (the same body and
words; test_vllm_gateway.py asks vLLM the same, and the gateway in front of it); the gateway
answers it as each protocol's own API does, so the real clients raise their context-window
error instead of retrying: the OpenAI SDK a BadRequestError with code
`context_length_exceeded`, the Anthropic SDK one whose body says "prompt is too long", litellm
(mini-swe-agent's client) `ContextWindowExceededError`. The call is recorded as failed, and it
is no incident of the attempt (the agent's own prompt was too long)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.integration.stack import Stack
from tests.integration.test_agent_protocols import anthropic_client, openai_client

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
SWE_PYTHON = ROOT / ".venv-swe" / "bin" / "python"
REFERENCE_CONTEXT = 2048  # the tiny model's, in the reference server
VLLM_CONTEXT = 8192  # the `vllm` preset's
# Over both contexts: the tiny tokenizer spells a run of "x" one token each.
TOO_LONG = "x" * 9000
USER = [{"role": "user", "content": TOO_LONG}]


def vllm_overflow_body(max_model_len: int) -> dict[str, Any]:
    """What vLLM 0.32 answers a text prompt over its context (its renderer tokenizes no
    further than one token past it, hence "at least")."""
    counted = max_model_len + 1
    return {
        "error": {
            "message": (
                f"This model's maximum context length is {max_model_len} tokens. However, "
                f"your prompt contains at least {counted} input tokens, which exceeds this "
                "limit even without any output tokens. Please reduce the length of the input "
                f"prompt. (parameter=input_tokens, value={counted})"
            ),
            "type": "BadRequestError",
            "param": "input_tokens",
            "code": 400,
        }
    }


def openai_overflow(max_model_len: int, prompt_tokens: int, field: str) -> str:
    return (
        f"This model's maximum context length is {max_model_len} tokens. However, your "
        f"{field} resulted in {prompt_tokens} tokens. Please reduce the length of the {field}."
    )


def policy_tokens(stack: Stack, body: dict[str, Any]) -> int:
    """How many prompt tokens the policy server counts (its /tokenize, vLLM's shape)."""
    model = httpx.get(f"{stack.policy_url}/v1/models", timeout=10).json()["data"][0]["id"]
    answer = httpx.post(f"{stack.policy_url}/tokenize", json={"model": model, **body}, timeout=60)
    answer.raise_for_status()
    count: int = answer.json()["count"]
    return count


async def assert_failed_call_not_incident(
    stack: Stack, rollout_id: str, protocol: str, message: str
) -> None:
    """The newest failed call of the rollout is this one (400, its protocol, the words the
    agent got), and the attempt has no incident."""
    failed = await stack.store().failed_calls(rollout_id, 1)
    assert (failed[-1].status, failed[-1].protocol, failed[-1].error) == (400, protocol, message)
    assert await stack.store().incidents(rollout_id, 1) == []


@pytest.fixture(scope="module")
async def rollout(stack: Stack) -> str:
    return await stack.start_idle_rollout("overflow")


# --- through the gateway to the reference server -----------------------------------------


@pytest.mark.parametrize("stream", [False, True])
async def test_chat_overflow_is_openais_context_length_exceeded(
    stack: Stack, rollout: str, stream: bool
) -> None:
    prompt_tokens = policy_tokens(stack, {"messages": USER, "add_generation_prompt": True})
    with pytest.raises(openai.BadRequestError) as refused:
        await openai_client(stack, rollout).chat.completions.create(
            model="m", messages=USER, max_tokens=4, stream=stream
        )
    message = openai_overflow(REFERENCE_CONTEXT, prompt_tokens, "messages")
    assert refused.value.status_code == 400  # before any stream began
    assert refused.value.body == {
        "message": message,
        "type": "invalid_request_error",
        "param": "messages",
        "code": "context_length_exceeded",
    }
    assert refused.value.code == "context_length_exceeded"
    await assert_failed_call_not_incident(stack, rollout, "chat.completions", message)


@pytest.mark.parametrize("stream", [False, True])
async def test_responses_overflow_names_the_input(stack: Stack, rollout: str, stream: bool) -> None:
    prompt_tokens = policy_tokens(stack, {"messages": USER, "add_generation_prompt": True})
    with pytest.raises(openai.BadRequestError) as refused:
        await openai_client(stack, rollout).responses.create(
            model="m", input=TOO_LONG, max_output_tokens=4, stream=stream
        )
    message = openai_overflow(REFERENCE_CONTEXT, prompt_tokens, "input")
    assert (refused.value.code, refused.value.param) == ("context_length_exceeded", "input")
    assert refused.value.body["message"] == message
    await assert_failed_call_not_incident(stack, rollout, "responses", message)


async def test_completions_overflow_names_the_prompt(stack: Stack, rollout: str) -> None:
    prompt_tokens = policy_tokens(stack, {"prompt": TOO_LONG})
    with pytest.raises(openai.BadRequestError) as refused:
        await openai_client(stack, rollout).completions.create(
            model="m", prompt=TOO_LONG, max_tokens=4
        )
    message = openai_overflow(REFERENCE_CONTEXT, prompt_tokens, "prompt")
    assert (refused.value.code, refused.value.param) == ("context_length_exceeded", "prompt")
    assert refused.value.body["message"] == message
    await assert_failed_call_not_incident(stack, rollout, "completions", message)


@pytest.mark.parametrize("stream", [False, True])
async def test_messages_overflow_is_anthropics_prompt_is_too_long(
    stack: Stack, rollout: str, stream: bool
) -> None:
    client = anthropic_client(stack, rollout)
    counted = await client.messages.count_tokens(model="m", messages=USER)  # type: ignore[arg-type]
    with pytest.raises(anthropic.BadRequestError) as refused:
        await client.messages.create(
            model="m",
            max_tokens=4,
            messages=USER,  # type: ignore[arg-type]
            stream=stream,
        )
    message = f"prompt is too long: {counted.input_tokens} tokens > {REFERENCE_CONTEXT} maximum"
    assert refused.value.status_code == 400
    assert refused.value.body == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": message},
    }
    await assert_failed_call_not_incident(stack, rollout, "messages", message)


LITELLM_CALLS = """
import json, sys
import litellm
base, key = sys.argv[1], sys.argv[2]
raised = []
for stream in (False, True):
    try:
        answer = litellm.completion(
            model="openai/x", api_base=base, api_key=key, max_tokens=4, stream=stream,
            messages=[{"role": "user", "content": "x" * 9000}], num_retries=0,
        )
        raised.append("nothing")
    except Exception as err:
        raised.append(type(err).__name__)
print(json.dumps(raised))
"""


async def test_litellm_raises_its_context_window_error(stack: Stack, rollout: str) -> None:
    """litellm 1.110 (mini-swe-agent's model client, which stops on this error instead of
    retrying) maps the gateway's chat answer to ContextWindowExceededError, whole and
    streamed."""
    if not (SWE_PYTHON.parent / "mini").is_file():
        pytest.skip(f"no mini-swe-agent venv at {SWE_PYTHON.parent.parent}: run `make swe`")
    env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    base = f"{stack.gateway_url}/rollouts/{rollout}/v1"
    ran = await asyncio.to_thread(
        subprocess.run,
        [str(SWE_PYTHON), "-c", LITELLM_CALLS, base, stack.token(rollout)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ran.returncode == 0, ran.stderr
    assert json.loads(ran.stdout.splitlines()[-1]) == ["ContextWindowExceededError"] * 2


# --- a policy server's own refusals, as vLLM 0.32 words them ----------------------------


def ask(url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    """POST to a policy server itself, past the gateway, naming the model it serves."""
    model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
    return httpx.post(f"{url}{path}", json={"model": model, **body}, timeout=120)


def budget_refusal(max_model_len: int) -> dict[str, Any]:
    asked = max_model_len + 1
    return {
        "error": {
            "message": (
                f"max_tokens={asked} cannot be greater than max_model_len={max_model_len}. "
                f"Please request fewer output tokens. (parameter=max_tokens, value={asked})"
            ),
            "type": "BadRequestError",
            "param": "max_tokens",
            "code": 400,
        }
    }


def check_refuses_as_vllm(url: str, context: int) -> None:
    """The requests both servers get (tests/integration/test_vllm_gateway.py asks a real
    vLLM 0.32 the same): a prompt over the context (chat, whole and
    streamed; a text completion) gets vLLM's 400 body, a completion budget over the context
    its other 400, and a prompt that fits with less room than asked is cut at the context's
    end (finish_reason "length") rather than refused."""
    for path, body in (
        ("/v1/chat/completions", {"messages": USER}),
        ("/v1/chat/completions", {"messages": USER, "stream": True}),
        ("/v1/completions", {"prompt": TOO_LONG, "max_tokens": 4}),
    ):
        answer = ask(url, path, body)
        assert (answer.status_code, answer.json()) == (400, vllm_overflow_body(context)), body
    hello = [{"role": "user", "content": "hi"}]
    budget = ask(url, "/v1/chat/completions", {"messages": hello, "max_tokens": context + 1})
    assert (budget.status_code, budget.json()) == (400, budget_refusal(context))

    fitting = [{"role": "user", "content": "x" * (context - 30)}]
    counted = ask(url, "/tokenize", {"messages": fitting, "add_generation_prompt": True})
    room = context - counted.json()["count"]
    cut = ask(
        url,
        "/v1/chat/completions",
        {"messages": fitting, "max_tokens": 64, "ignore_eos": True},
    )
    assert cut.status_code == 200, cut.text
    assert 0 < room < 64
    assert cut.json()["choices"][0]["finish_reason"] == "length"
    assert cut.json()["usage"]["completion_tokens"] == room


def test_the_reference_server_refuses_as_vllm_does(stack: Stack) -> None:
    check_refuses_as_vllm(stack.policy_url, REFERENCE_CONTEXT)
