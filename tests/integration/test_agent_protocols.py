"""The Responses API and the Anthropic Messages API through the real gateway to the reference
policy server, driven by the official `openai` and `anthropic` SDKs: every call is recorded
token-exact as a chat call with its protocol noted, tool calls round-trip, a multi-turn
tool-using rollout merges into one training row, and the answers parse as the SDKs' types."""

from __future__ import annotations

import asyncio
import base64
import json
import uuid
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from darl.deploy.temporal_connection import DATA_CONVERTER
from darl.gateway.store.record import CallRecord
from darl.workflows.contracts import (
    CLOSE_LISTED,
    LocalAgentSpec,
    RewardSpec,
    RolloutSpec,
    RolloutTimeouts,
)
from darl.workflows.rollout_status import RolloutStatus
from tests.integration.protocol_checks import (
    ADD_SCHEMA,
    assert_token_exact,
    extends,
    trajectory_counters,
)
from tests.integration.stack import Stack

RESPONSES_TOOLS: list[Any] = [
    {"type": "function", "name": "add", "description": "a + b", "parameters": ADD_SCHEMA}
]
ROOT = Path(__file__).resolve().parents[2]
ANTHROPIC_TOOLS: list[Any] = [{"name": "add", "description": "a + b", "input_schema": ADD_SCHEMA}]


def openai_client(stack: Stack, rollout_id: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=f"{stack.gateway_url}/rollouts/{rollout_id}/v1",
        api_key=stack.token(rollout_id),
        max_retries=0,
        timeout=120,
    )


def anthropic_client(stack: Stack, rollout_id: str) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(
        base_url=f"{stack.gateway_url}/rollouts/{rollout_id}",
        api_key=stack.token(rollout_id),
        max_retries=0,
        timeout=120,
    )


def records_of(stack: Stack, rollout_id: str) -> list[CallRecord]:
    return stack.store().read_sync(rollout_id)


def assert_arguments(arguments: dict[str, Any]) -> None:
    assert sorted(arguments) == ["a", "b"]
    assert all(isinstance(v, int) for v in arguments.values())


# --- the Responses API --------------------------------------------------------------------


async def test_responses_text_whole_and_streamed(stack: Stack) -> None:
    rollout = await stack.start_idle_rollout("responses-text")
    client = openai_client(stack, rollout)
    whole = await client.responses.create(
        model="any",
        instructions="Answer briefly.",
        input="What is 2 + 3?",
        max_output_tokens=12,
        include=["message.output_text.logprobs"],
    )
    events = [
        e
        async for e in await client.responses.create(
            model="any",
            input=[{"role": "user", "content": "Hi"}],
            max_output_tokens=12,
            stream=True,
        )
    ]

    records = records_of(stack, rollout)
    assert [r.protocol for r in records] == ["responses", "responses"]
    assert [r.endpoint for r in records] == ["chat.completions"] * 2
    assert [r.streamed for r in records] == [False, True]
    assert_token_exact(records, stack.policy_responses())

    assert whole.id == f"resp_{records[0].call_id}"
    assert whole.output_text == records[0].response["choices"][0]["message"]["content"]
    assert whole.usage is not None
    assert whole.usage.output_tokens == len(records[0].completion_token_ids())
    assert whole.usage.input_tokens == len(records[0].prompt_token_ids)
    shown = whole.output[0].content[0].logprobs  # type: ignore[union-attr]
    assert [p.logprob for p in shown] == records[0].completion_logprobs()
    assert records[0].request["messages"][0] == {"role": "system", "content": "Answer briefly."}

    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    final = events[-1].response  # type: ignore[union-attr]
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text == records[1].response["choices"][0]["message"]["content"]
    assert final.id == f"resp_{records[1].call_id}"


@pytest.mark.parametrize("stream", [False, True])
async def test_responses_tool_call_round_trip(stack: Stack, stream: bool) -> None:
    rollout = await stack.start_idle_rollout("responses-tools")
    client = openai_client(stack, rollout)

    async def create(**kwargs: Any) -> Any:
        if not stream:
            return await client.responses.create(model="any", max_output_tokens=160, **kwargs)
        events = [
            e
            async for e in await client.responses.create(
                model="any", max_output_tokens=160, stream=True, **kwargs
            )
        ]
        return events[-1].response

    first = await create(input="What is 2 + 3?", tools=RESPONSES_TOOLS, tool_choice="required")
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "add"
    assert_arguments(json.loads(calls[0].arguments))
    # As the OpenAI Agents SDK does: the whole conversation again, the call's output appended.
    await create(
        input=[
            {"role": "user", "content": "What is 2 + 3?"},
            *[item.model_dump(exclude_none=True) for item in first.output],
            {"type": "function_call_output", "call_id": calls[0].call_id, "output": "5"},
        ],
        tools=RESPONSES_TOOLS,
        tool_choice="required",
    )
    # As a stateless client does: only the new items after `previous_response_id`.
    await create(
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "5"}],
        tools=RESPONSES_TOOLS,
    )

    records = records_of(stack, rollout)
    assert len(records) == 3
    assert_token_exact(records, stack.policy_responses())
    assert records[0].response["choices"][0]["finish_reason"] == "tool_calls"
    # Both ways of continuing send the policy the same conversation, extending the first.
    assert records[1].request["messages"] == records[2].request["messages"]
    assert extends(records[0], records[1]) and extends(records[0], records[2])
    counters = trajectory_counters(records[:2])
    assert (counters.rows, counters.merge_mismatches) == (1, 0)


# --- the Anthropic Messages API -----------------------------------------------------------


async def test_messages_text_whole_and_streamed(stack: Stack) -> None:
    rollout = await stack.start_idle_rollout("messages-text")
    client = anthropic_client(stack, rollout)
    whole = await client.messages.create(
        model="any",
        system="Answer briefly.",
        max_tokens=12,
        messages=[{"role": "user", "content": "What is 2 + 3?"}],
    )
    async with client.messages.stream(
        model="any",
        max_tokens=12,
        messages=[{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
    ) as stream:
        streamed_text = "".join([text async for text in stream.text_stream])
        final = await stream.get_final_message()

    records = records_of(stack, rollout)
    assert [r.protocol for r in records] == ["messages", "messages"]
    assert [r.streamed for r in records] == [False, True]
    assert_token_exact(records, stack.policy_responses())

    text = records[0].response["choices"][0]["message"]["content"]
    assert "".join(b.text for b in whole.content if b.type == "text") == text
    assert whole.id == f"msg_{records[0].call_id}"
    assert whole.stop_reason in ("end_turn", "max_tokens")
    assert whole.usage.output_tokens == len(records[0].completion_token_ids())
    assert streamed_text == records[1].response["choices"][0]["message"]["content"]
    assert final.usage.output_tokens == len(records[1].completion_token_ids())
    assert final.id == f"msg_{records[1].call_id}"


@pytest.mark.parametrize("stream", [False, True])
async def test_messages_multi_turn_tool_use(stack: Stack, stream: bool) -> None:
    rollout = await stack.start_idle_rollout("messages-tools")
    client = anthropic_client(stack, rollout)

    async def create(**kwargs: Any) -> anthropic.types.Message:
        if not stream:
            return await client.messages.create(model="any", max_tokens=160, **kwargs)
        async with client.messages.stream(model="any", max_tokens=160, **kwargs) as events:
            return await events.get_final_message()

    messages: list[Any] = [{"role": "user", "content": "What is 2 + 3? Then add 4."}]
    for _turn in range(2):
        answer = await create(messages=messages, tools=ANTHROPIC_TOOLS, tool_choice={"type": "any"})
        uses = [b for b in answer.content if b.type == "tool_use"]
        assert answer.stop_reason == "tool_use" and len(uses) == 1
        assert_arguments(uses[0].input)  # type: ignore[arg-type]
        messages += [
            {"role": "assistant", "content": [b.model_dump() for b in answer.content]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "5"}],
            },
        ]
    last = await create(messages=messages, tools=ANTHROPIC_TOOLS)
    assert last.stop_reason in ("end_turn", "max_tokens", "tool_use")

    records = records_of(stack, rollout)
    assert len(records) == 3
    assert_token_exact(records, stack.policy_responses())
    assert extends(records[0], records[1]) and extends(records[1], records[2])
    counters = trajectory_counters(records)
    assert (counters.rows, counters.merge_mismatches) == (1, 0)


async def test_messages_count_tokens(stack: Stack) -> None:
    rollout = await stack.start_idle_rollout("messages-count")
    client = anthropic_client(stack, rollout)
    request: dict[str, Any] = {
        "model": "any",
        "messages": [{"role": "user", "content": "What is 2 + 3?"}],
        "tools": ANTHROPIC_TOOLS,
    }
    counted = await client.messages.count_tokens(**request)
    answer = await client.messages.create(max_tokens=4, **request)
    assert counted.input_tokens == answer.usage.input_tokens > 0


# --- failed calls -------------------------------------------------------------------------


async def test_failed_calls_are_recorded_and_counted(stack: Stack) -> None:
    """A prompt longer than the policy's context gets the protocol's 400; the call is kept as
    failed (status, error, latency), counted in the rollout's result, and never trained on."""
    spec = RolloutSpec(
        run_id="failed-calls",
        rollout_id=f"failed-{uuid.uuid4().hex[:8]}",
        task={},
        agent=LocalAgentSpec(
            command=["{python}", "-m", "tests.agents.too_long_agent"], cwd=str(ROOT)
        ),
        timeouts=RolloutTimeouts(agent_seconds=120),
    )
    result = await asyncio.wait_for((await stack.start_rollout(spec)).result(), 180)

    assert result.status == RolloutStatus.SUCCEEDED, result.error
    assert (result.reward, result.calls, result.failed_calls) == (0.5, 1, 2)
    assert [e.split(":")[0] for e in result.failed_call_errors] == [
        "400 (messages)",
        "400 (responses)",
    ]
    failed = await stack.store().failed_calls(spec.rollout_id, 1)
    assert [(f.status, f.protocol) for f in failed] == [(400, "messages"), (400, "responses")]
    # Each in its protocol's words for a prompt over the context (test_context_overflow.py).
    assert failed[0].error.startswith("prompt is too long: "), failed
    assert failed[0].error.endswith(" tokens > 2048 maximum"), failed
    assert failed[1].error.startswith("This model's maximum context length is 2048 tokens"), failed
    assert all(f.latency_ms > 0 and f.retry_count == 0 for f in failed)
    assert [r.call_id for r in records_of(stack, spec.rollout_id)] == result.call_ids


async def test_an_attempt_that_fails_many_calls_hands_its_workflow_the_first_few(stack: Stack):
    """An agent can make thousands of calls that fail: its close hands the workflow the first
    CLOSE_LISTED and their count (await_agent's result stays within its budget), and the
    rollout counts them all."""
    flood = 3 * CLOSE_LISTED
    spec = RolloutSpec(
        run_id="failed-calls",
        rollout_id=f"flood-{uuid.uuid4().hex[:8]}",
        task={},
        agent=LocalAgentSpec(
            command=["{python}", "-m", "tests.agents.too_long_agent"],
            cwd=str(ROOT),
            env={"FLOOD": str(flood)},
        ),
        timeouts=RolloutTimeouts(agent_seconds=120),
    )
    handle = await stack.start_rollout(spec)
    result = await asyncio.wait_for(handle.result(), 180)
    assert result.status == RolloutStatus.SUCCEEDED, result.error
    assert result.failed_calls == flood + 2 and len(result.failed_call_errors) == 5
    converter = DATA_CONVERTER.payload_converter
    exits = [
        converter.from_payloads(event.activity_task_completed_event_attributes.result.payloads)[0]
        async for event in handle.fetch_history_events()
        if event.HasField("activity_task_completed_event_attributes")
    ]
    (agent_exit,) = [e for e in exits if isinstance(e, dict) and "failed_calls" in e]
    assert len(agent_exit["failed_calls"]) == CLOSE_LISTED
    assert agent_exit["failed_call_count"] == flood + 2


# --- the example agents, unchanged SDK programs -------------------------------------------


@pytest.mark.parametrize("stream", ["0", "1"])
async def test_sdk_example_agents_train_through_darl(stack: Stack, stream: str) -> None:
    """The OpenAI Agents SDK calculator agent and the Anthropic tool-use agent as rollouts:
    both succeed, each forced tool call comes back as a function call / tool_use the agent
    runs, every call is recorded token-exact, and each rollout's calls merge into one
    training row (0 merge mismatches: every prompt extends the one before)."""
    task = {"question": "What is 3 + 4?", "answer": "7"}
    specs = [
        RolloutSpec(
            run_id="sdk-examples",
            rollout_id=f"{name}-{uuid.uuid4().hex[:8]}",
            task=task,
            agent=LocalAgentSpec(
                command=["{python}", "-m", f"darl.examples.{name}.agent"],
                env={"AGENT_STREAM": stream},
            ),
            reward=RewardSpec(function="numeric_match"),
            timeouts=RolloutTimeouts(agent_seconds=180),
        )
        for name in ("agents_sdk_calculator", "anthropic_tools")
    ]
    handles = [await stack.start_rollout(spec) for spec in specs]
    done = [await asyncio.wait_for(h.result(), 240) for h in handles]

    assert [r.status for r in done] == [RolloutStatus.SUCCEEDED] * 2, [r.error for r in done]
    served = stack.policy_responses()
    for result, protocol in zip(done, ("responses", "messages"), strict=True):
        assert result.reward in (0.0, 1.0)
        assert result.metadata["tool_calls"] >= 1, result.metadata
        records = stack.store().read_sync(result.rollout_id, call_ids=result.call_ids)
        assert len(records) >= 2 and {r.protocol for r in records} == {protocol}
        assert {r.streamed for r in records} == {stream == "1"}
        assert records[0].response["choices"][0]["message"]["tool_calls"]
        assert_token_exact(records, served)
        counters = trajectory_counters(records)
        assert (counters.rows, counters.merge_mismatches) == (1, 0), result.rollout_id


async def test_images_reach_the_policy_which_refuses_them(stack: Stack) -> None:
    """An image block (Messages) or part (Responses) is translated, not dropped: the tiny text
    policy refuses it with a 400 that reaches the agent in its protocol's shape."""
    rollout = await stack.start_idle_rollout("images")
    pixel = base64.b64encode(b"\x89PNG\r\n\x1a\n a one-pixel picture").decode()
    with pytest.raises(anthropic.BadRequestError) as refused:
        await anthropic_client(stack, rollout).messages.create(
            model="any",
            max_tokens=4,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "What is this?"},
                        {
                            "type": "image",
                            "source": {"type": "base64", "media_type": "image/png", "data": pixel},
                        },
                    ],
                }
            ],
        )
    assert "text only" in refused.value.body["error"]["message"]  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as also:
        await openai_client(stack, rollout).responses.create(
            model="any",
            max_output_tokens=4,
            input=[
                {
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "What is this?"},
                        {"type": "input_image", "image_url": f"data:image/png;base64,{pixel}"},
                    ],
                }
            ],
        )
    assert "text only" in str(also.value)
    failed = await stack.store().failed_calls(rollout, 1)
    assert [(f.status, f.protocol) for f in failed] == [(400, "messages"), (400, "responses")]
    assert records_of(stack, rollout) == []


CAPTURED = "darl_gateway_captured_calls_total"


def counter(metrics: str, series: str) -> float:
    """A Prometheus counter's value from the text exposition (0 when it has no such series)."""
    for line in metrics.splitlines():
        if line.startswith(series + " "):
            return float(line.split()[1])
    return 0.0


async def test_metrics_name_the_protocol_the_agent_spoke(stack: Stack) -> None:
    rollout = await stack.start_idle_rollout("protocol-metrics")
    series = {
        "responses route": 'darl_gateway_requests_total{route="responses",status="200"}',
        "messages route": 'darl_gateway_requests_total{route="messages",status="200"}',
        "responses calls": CAPTURED + '{protocol="responses",streamed="false"}',
        "messages calls": CAPTURED + '{protocol="messages",streamed="false"}',
        "other route": 'darl_gateway_requests_total{route="other",status="200"}',
    }
    async with httpx.AsyncClient(base_url=stack.gateway_url, timeout=30) as http:
        before = (await http.get("/metrics")).text
        await openai_client(stack, rollout).responses.create(
            model="any", input="What is 2 + 3?", max_output_tokens=4
        )
        await anthropic_client(stack, rollout).messages.create(
            model="any", max_tokens=4, messages=[{"role": "user", "content": "Hi"}]
        )
        after = (await http.get("/metrics")).text
    grew = {name: counter(after, s) - counter(before, s) for name, s in series.items()}
    assert grew == {
        "responses route": 1,
        "messages route": 1,
        "responses calls": 1,
        "messages calls": 1,
        "other route": 0,
    }
