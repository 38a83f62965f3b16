"""The gateway in front of a real vLLM (CPU build, .venv-vllm) serving a reference trainer
checkpoint: agent rollouts, and calls the test makes as an agent, are recorded with the token
ids and logprobs exactly as vLLM answered them, for chat (whole and streamed) and completions
(whole and streamed). The gateway forces temperature 0 here, so asking vLLM the same thing
directly must give the same answer."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from temporalio.testing import WorkflowEnvironment

from darl.gateway.store.record import CallRecord
from darl.workflows.rollout_status import RolloutStatus
from tests.integration.test_agent_protocols import anthropic_client, openai_client
from tests.integration.test_context_overflow import (
    USER,
    VLLM_CONTEXT,
    assert_failed_call_not_incident,
    check_refuses_as_vllm,
    openai_overflow,
    policy_tokens,
)
from tests.integration.test_rollouts_e2e import example_spec
from tests.vllm_fixtures import VllmStack, running_vllm_stack

pytestmark = pytest.mark.integration

RESULT_TIMEOUT = 240


@pytest.fixture(scope="module")
def vllm_stack(
    dev_env: WorkflowEnvironment, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[VllmStack]:
    yield from running_vllm_stack(dev_env.client, Path(tmp_path_factory.mktemp("vllm-gateway")))


def post(stack: VllmStack, rollout_id: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(
        f"{stack.gateway_url}/rollouts/{rollout_id}/v1/{path}",
        json=body,
        headers={"Authorization": f"Bearer {stack.token(rollout_id)}"},
        timeout=60,
    )


def stream(
    stack: VllmStack, rollout_id: str, path: str, body: dict[str, Any]
) -> tuple[str, list[dict[str, Any]]]:
    """The call id and the chunks the agent received."""
    chunks = []
    with httpx.stream(
        "POST",
        f"{stack.gateway_url}/rollouts/{rollout_id}/v1/{path}",
        json={**body, "stream": True},
        headers={"Authorization": f"Bearer {stack.token(rollout_id)}"},
        timeout=60,
    ) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:]))
        return response.headers["x-darl-call-id"], chunks


def stored(stack: VllmStack, rollout_id: str, call_id: str) -> CallRecord:
    (record,) = stack.store().read_sync(rollout_id, call_ids=[call_id])
    return record


def choice_of(answer: dict[str, Any]) -> dict[str, Any]:
    return answer["choices"][0]


def prompt_ids_of(endpoint: str, answer: dict[str, Any]) -> list[int]:
    if endpoint == "chat.completions":
        return answer["prompt_token_ids"]
    return choice_of(answer)["prompt_token_ids"]


def assert_vllm_answers_the_same(stack: VllmStack, record: CallRecord) -> None:
    """vLLM, asked directly what the gateway forwarded, gives the record's ids and logprobs."""
    direct = stack.replay(record)
    assert record.prompt_token_ids == prompt_ids_of(record.endpoint, direct)
    assert record.completion_token_ids() == choice_of(direct)["token_ids"]
    assert record.response["choices"][0]["logprobs"] == choice_of(direct)["logprobs"]
    assert record.response["choices"][0]["finish_reason"] == choice_of(direct)["finish_reason"]


async def test_agent_rollouts_record_what_vllm_answered(vllm_stack: VllmStack) -> None:
    """Real OpenAI-SDK agents (one call whole; two calls streamed, the second carrying the
    first's answer): the workflow's counts and the store's records match vLLM's answers."""
    specs = [example_spec("darl.examples.arithmetic.agent", i) for i in (0, 1)] + [
        example_spec("darl.examples.arithmetic.calculator_agent", i, {"AGENT_STREAM": "1"})
        for i in (2, 3)
    ]
    handles = [await vllm_stack.start_rollout(s) for s in specs]
    done = [await asyncio.wait_for(h.result(), RESULT_TIMEOUT) for h in handles]

    assert [r.status for r in done] == [RolloutStatus.SUCCEEDED] * 4, [r.error for r in done]
    assert [r.calls for r in done] == [1, 1, 2, 2]
    for result in done:
        records = vllm_stack.store().read_sync(result.rollout_id, call_ids=result.call_ids)
        assert [r.streamed for r in records] == [result.calls == 2] * result.calls
        assert {r.policy_version for r in records} == {0}
        assert result.prompt_tokens == sum(len(r.prompt_token_ids) for r in records)
        assert result.completion_tokens == sum(len(r.completion_token_ids()) for r in records)
        for record in records:
            assert record.request["temperature"] == 0.0
            assert record.request["return_token_ids"] is True
            logprobs = record.completion_logprobs()
            assert logprobs is not None
            assert len(logprobs) == len(record.completion_token_ids()) > 0
            assert_vllm_answers_the_same(vllm_stack, record)


async def test_a_chat_answer_is_recorded_as_vllm_sent_it(vllm_stack: VllmStack) -> None:
    rollout_id = await vllm_stack.start_idle_rollout("vllm-chat")
    models = httpx.get(
        f"{vllm_stack.gateway_url}/rollouts/{rollout_id}/v1/models",
        headers={"Authorization": f"Bearer {vllm_stack.token(rollout_id)}"},
    )
    assert [m["id"] for m in models.json()["data"]] == ["darl-tiny"]  # asked of vLLM
    body = {
        "model": "policy",
        "messages": [{"role": "user", "content": "What is 2 + 3?"}],
        "max_tokens": 16,
        "top_logprobs": 3,
    }
    answer = post(vllm_stack, rollout_id, "chat/completions", body)
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-darl-policy-version"] == "0"
    record = stored(vllm_stack, rollout_id, answer.headers["x-darl-call-id"])
    # The store holds vLLM's answer whole, as the agent received it but for the prompt's ids,
    # which go back only to an agent that asks for them (`return_token_ids`).
    assert answer.json() == {**record.response, "prompt_token_ids": None}
    assert len(record.prompt_token_ids) > 1
    content = choice_of(answer.json())["logprobs"]["content"]
    assert len(content) == len(record.completion_token_ids()) == 16
    assert all(len(entry["top_logprobs"]) == 3 for entry in content)
    assert record.completion_logprobs() == [entry["logprob"] for entry in content]
    assert_vllm_answers_the_same(vllm_stack, record)
    handle = vllm_stack.client.get_workflow_handle(f"rollout/{rollout_id}")
    assert await vllm_stack.wait_for_calls(handle, 1) == 1
    await handle.cancel()


async def test_a_streamed_chat_is_recorded_as_vllm_streamed_it(vllm_stack: VllmStack) -> None:
    rollout_id = await vllm_stack.start_idle_rollout("vllm-stream")
    body = {
        "model": "policy",
        "messages": [{"role": "user", "content": "Count to five."}],
        "max_tokens": 24,
        "top_logprobs": 2,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }
    call_id, chunks = stream(vllm_stack, rollout_id, "chat/completions", body)
    # vLLM sends the prompt ids in the first chunk, each token's id and logprob entry in its
    # own chunk, the finish reason with the last token, then the usage.
    parts = [c for chunk in chunks for c in chunk["choices"]]
    token_ids = [t for c in parts for t in c.get("token_ids") or []]
    entries = [e for c in parts if c.get("logprobs") for e in c["logprobs"]["content"]]
    text = "".join(c["delta"].get("content") or "" for c in parts)
    finish = [c["finish_reason"] for c in parts if c["finish_reason"] is not None]
    usage = [chunk["usage"] for chunk in chunks if chunk.get("usage")]

    record = stored(vllm_stack, rollout_id, call_id)
    assert record.streamed
    assert record.prompt_token_ids == chunks[0]["prompt_token_ids"]
    assert record.completion_token_ids() == token_ids
    assert len(token_ids) == 24
    recorded = choice_of(record.response)
    assert recorded["logprobs"]["content"] == entries
    assert recorded["message"]["content"] == text
    assert [recorded["finish_reason"]] == finish == ["length"]
    assert [record.response["usage"]] == usage
    assert usage[0]["completion_tokens"] == 24
    assert_vllm_answers_the_same(vllm_stack, record)
    handle = vllm_stack.client.get_workflow_handle(f"rollout/{rollout_id}")
    assert await vllm_stack.wait_for_calls(handle, 1) == 1
    await handle.cancel()


async def test_completions_are_recorded_as_vllm_answered(vllm_stack: VllmStack) -> None:
    rollout_id = await vllm_stack.start_idle_rollout("vllm-completions")
    body = {
        "model": "policy",
        "prompt": "2 + 2 =",
        "max_tokens": 12,
        "logprobs": 2,
        "return_token_ids": True,
    }
    answer = post(vllm_stack, rollout_id, "completions", body)
    assert answer.status_code == 200, answer.text
    whole = stored(vllm_stack, rollout_id, answer.headers["x-darl-call-id"])
    assert whole.response == answer.json()
    assert whole.prompt_token_ids == choice_of(answer.json())["prompt_token_ids"]
    assert whole.completion_logprobs() == choice_of(answer.json())["logprobs"]["token_logprobs"]
    assert len(whole.completion_token_ids()) == 12
    assert_vllm_answers_the_same(vllm_stack, whole)

    # A token-id prompt (the previous prompt and answer), streamed.
    prompt = whole.prompt_token_ids + whole.completion_token_ids()
    call_id, chunks = stream(
        vllm_stack, rollout_id, "completions", {**body, "prompt": prompt, "max_tokens": 10}
    )
    parts = [c for chunk in chunks for c in chunk["choices"]]
    streamed = stored(vllm_stack, rollout_id, call_id)
    assert streamed.streamed
    assert streamed.prompt_token_ids == parts[0]["prompt_token_ids"] == prompt
    assert streamed.completion_token_ids() == [t for c in parts for t in c["token_ids"]]
    logprobs = choice_of(streamed.response)["logprobs"]
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert logprobs[key] == [x for c in parts for x in c["logprobs"][key]], key
    assert choice_of(streamed.response)["text"] == "".join(c["text"] for c in parts)
    assert_vllm_answers_the_same(vllm_stack, streamed)
    handle = vllm_stack.client.get_workflow_handle(f"rollout/{rollout_id}")
    assert await vllm_stack.wait_for_calls(handle, 2) == 2
    await handle.cancel()


# --- the Responses and Messages APIs, translated to chat calls -----------------------------


async def test_responses_and_messages_are_recorded_as_vllm_answered(
    vllm_stack: VllmStack,
) -> None:
    """Through the official SDKs, whole and streamed: each call is recorded as the chat call
    it became, and vLLM asked that chat call directly answers the same ids and logprobs."""
    rollout_id = await vllm_stack.start_idle_rollout("vllm-protocols")
    token = vllm_stack.token(rollout_id)
    base = f"{vllm_stack.gateway_url}/rollouts/{rollout_id}"
    gpt = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=token, max_retries=0, timeout=120)
    claude = anthropic.AsyncAnthropic(base_url=base, api_key=token, max_retries=0, timeout=120)

    whole = await gpt.responses.create(model="policy", input="What is 2 + 3?", max_output_tokens=12)
    streamed = [
        e
        async for e in await gpt.responses.create(
            model="policy", input="Count to five.", max_output_tokens=12, stream=True
        )
    ]
    message = await claude.messages.create(
        model="policy", max_tokens=12, messages=[{"role": "user", "content": "What is 2 + 3?"}]
    )
    async with claude.messages.stream(
        model="policy", max_tokens=12, messages=[{"role": "user", "content": "Count to five."}]
    ) as events:
        final = await events.get_final_message()

    records = vllm_stack.store().read_sync(rollout_id)
    assert [(r.protocol, r.streamed) for r in records] == [
        ("responses", False),
        ("responses", True),
        ("messages", False),
        ("messages", True),
    ]
    for record in records:
        assert len(record.completion_token_ids()) == 12
        assert_vllm_answers_the_same(vllm_stack, record)
    texts = [choice_of(r.response)["message"]["content"] for r in records]
    assert whole.output_text == texts[0]
    assert streamed[-1].response.output_text == texts[1]  # type: ignore[union-attr]
    assert [b.text for b in message.content if b.type == "text"] == [texts[2]]
    assert [b.text for b in final.content if b.type == "text"] == [texts[3]]
    assert message.stop_reason == final.stop_reason == "max_tokens"
    handle = vllm_stack.client.get_workflow_handle(f"rollout/{rollout_id}")
    assert await vllm_stack.wait_for_calls(handle, 4) == 4
    await handle.cancel()


# An enum keeps a forced call short; greedy decoding would not end it (vLLM's tool-call grammar
# allows free whitespace, and the random policy's most likely token there is a tab).
OP_SCHEMA = {
    "type": "object",
    "properties": {"op": {"type": "string", "enum": ["add", "sub"]}},
    "required": ["op"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("stream", [False, True])
async def test_tool_calls_through_vllm(vllm_stack: VllmStack, stream: bool) -> None:
    """vLLM's own tool calling (`--tool-call-parser hermes`, a forced choice constrained by
    its grammar): a Responses function call and an Anthropic tool_use round-trip, and each
    call is what vLLM answers when asked directly. The token is a `val` one, so the gateway
    forces temperature 0.7, and a seed (vLLM's extension, sent as `extra_body`) makes the
    sampled call repeatable. (vLLM re-renders a forced call with other whitespace than it
    generated, so its prompts do not extend each other: see docs/limitations.md.)"""
    rollout_id = await vllm_stack.start_idle_rollout("vllm-tools")
    token = vllm_stack.token(rollout_id, mode="val")
    base = f"{vllm_stack.gateway_url}/rollouts/{rollout_id}"
    gpt = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=token, max_retries=0, timeout=180)
    claude = anthropic.AsyncAnthropic(base_url=base, api_key=token, max_retries=0, timeout=180)
    tool = {"type": "function", "name": "pick", "parameters": OP_SCHEMA, "strict": True}
    seed = {"seed": 1}

    async def respond(**kwargs: Any) -> Any:
        if not stream:
            return await gpt.responses.create(model="policy", extra_body=seed, **kwargs)
        events = [
            e
            async for e in await gpt.responses.create(
                model="policy", stream=True, extra_body=seed, **kwargs
            )
        ]
        return events[-1].response

    first = await respond(
        input="Add or subtract?", tools=[tool], tool_choice="required", max_output_tokens=400
    )
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls and all(c.name == "pick" for c in calls)
    assert all(json.loads(c.arguments)["op"] in ("add", "sub") for c in calls)
    await respond(
        previous_response_id=first.id,
        input=[
            {"type": "function_call_output", "call_id": c.call_id, "output": "done"} for c in calls
        ],
        tools=[tool],
        max_output_tokens=8,
    )
    request: dict[str, Any] = {
        "model": "policy",
        "max_tokens": 400,
        "messages": [{"role": "user", "content": "Add or subtract?"}],
        "tools": [{"name": "pick", "input_schema": OP_SCHEMA, "strict": True}],
        "tool_choice": {"type": "tool", "name": "pick"},
        "extra_body": seed,
    }
    if stream:
        async with claude.messages.stream(**request) as events:
            used = await events.get_final_message()
    else:
        used = await claude.messages.create(**request)
    (use,) = [b for b in used.content if b.type == "tool_use"]
    assert use.name == "pick" and use.input["op"] in ("add", "sub")  # type: ignore[index]

    records = vllm_stack.store().read_sync(rollout_id)
    assert [r.protocol for r in records] == ["responses", "responses", "messages"]
    assert len(choice_of(records[0].response)["message"]["tool_calls"]) == len(calls)
    for record in records:
        assert record.streamed is stream
        assert record.request["seed"] == 1
        assert_vllm_answers_the_same(vllm_stack, record)
    handle = vllm_stack.client.get_workflow_handle(f"rollout/{rollout_id}")
    assert await vllm_stack.wait_for_calls(handle, 3) == 3
    await handle.cancel()


# --- a prompt over the context (tests/integration/test_context_overflow.py) -----------------


def test_vllm_refuses_as_the_reference_server_does(vllm_stack: VllmStack) -> None:
    check_refuses_as_vllm(vllm_stack.policy_url, VLLM_CONTEXT)


async def test_the_gateway_says_vllms_overflow_in_each_protocol(vllm_stack: VllmStack) -> None:
    rollout = await vllm_stack.start_idle_rollout("vllm-overflow")
    prompt_tokens = policy_tokens(vllm_stack, {"messages": USER, "add_generation_prompt": True})
    with pytest.raises(openai.BadRequestError) as chat_refused:
        await openai_client(vllm_stack, rollout).chat.completions.create(
            model="m", messages=USER, max_tokens=4
        )
    message = openai_overflow(VLLM_CONTEXT, prompt_tokens, "messages")
    assert chat_refused.value.code == "context_length_exceeded"
    assert chat_refused.value.body["message"] == message  # type: ignore[index]
    await assert_failed_call_not_incident(vllm_stack, rollout, "chat.completions", message)

    claude = anthropic_client(vllm_stack, rollout)
    counted = await claude.messages.count_tokens(model="m", messages=USER)  # type: ignore[arg-type]
    with pytest.raises(anthropic.BadRequestError) as messages_refused:
        await claude.messages.create(
            model="m",
            max_tokens=4,
            messages=USER,  # type: ignore[arg-type]
            stream=True,
        )
    message = f"prompt is too long: {counted.input_tokens} tokens > {VLLM_CONTEXT} maximum"
    assert messages_refused.value.body == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": message},
    }
    await assert_failed_call_not_incident(vllm_stack, rollout, "messages", message)
