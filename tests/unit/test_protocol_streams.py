"""The Responses and Messages translations of a chat stream, read back by the official SDKs'
own stream accumulators (`responses.stream`, `messages.stream`, over a mock transport): what
an agent assembles from the events is the whole answer the gateway would have sent."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import httpx2
import openai
import pytest

from darl.gateway.protocols.chat.capture import StreamAssembler, split_sse, sse_data
from darl.gateway.protocols.messages.protocol import MessagesRequest
from darl.gateway.protocols.messages.translation import MessagesTranslation
from darl.gateway.protocols.responses.protocol import ResponsesRequest
from darl.gateway.protocols.responses.translation import ResponsesTranslation
from darl.gateway.protocols.translation import Translation

CALL_ID = "0123456789abcdef0123456789abcdef"
ADD = {"type": "object", "properties": {"a": {"type": "integer"}}}


def call_delta(index: int, call_id: str, arguments: str) -> dict[str, Any]:
    function = {"name": "add", "arguments": arguments}
    return {
        "tool_calls": [{"index": index, "id": call_id, "type": "function", "function": function}]
    }


# vLLM streams a call's name first, then its arguments in pieces.
VLLM_CALL = [
    {"tool_calls": [{"index": 0, "id": "call_v", "type": "function", "function": {"name": "add"}}]},
    {"tool_calls": [{"index": 0, "function": {"arguments": '{"a": '}}]},
    {"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]},
]

CASES: dict[str, tuple[list[dict[str, Any]], str, str | None]] = {
    "text": (
        [{"role": "assistant", "content": ""}, {"content": "Hel"}, {"content": "lo"}],
        "stop",
        None,
    ),
    "empty": ([], "stop", None),
    "stop string": ([{"content": "2 + 2 = 4"}], "stop", "END"),
    "length": ([{"content": "abc"}], "length", None),
    "one call": ([call_delta(0, "call_a", '{"a": 1}')], "tool_calls", None),
    "text, then a call": (
        [{"content": "Let me"}, call_delta(0, "call_a", '{"a": 1}')],
        "tool_calls",
        None,
    ),
    "vLLM's pieces": (VLLM_CALL, "tool_calls", None),
}


def chat_chunks(
    deltas: list[dict[str, Any]], finish: str, stop: str | None
) -> list[dict[str, Any]]:
    head = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "tiny"}
    chunks = [
        {
            **head,
            **({"prompt_token_ids": [1, 2, 3]} if i == 0 else {}),
            "choices": [
                {
                    "index": 0,
                    "delta": delta,
                    "finish_reason": None,
                    "token_ids": [10 + i],
                    "logprobs": {"content": [{"token": "x", "logprob": -0.5, "bytes": [120]}]},
                }
            ],
        }
        for i, delta in enumerate(deltas)
    ]
    end = {"index": 0, "delta": {}, "finish_reason": finish, "token_ids": [], "stop_reason": stop}
    return [*chunks, {**head, "choices": [end]}]


def without_none(value: Any) -> Any:
    """The SDKs leave out what is None; compare what is said."""
    if isinstance(value, dict):
        return {k: without_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [without_none(v) for v in value]
    return value


def translated(translation: Translation, chunks: list[dict[str, Any]]) -> tuple[bytes, Any]:
    """The SSE the agent gets, and the assembled chat answer the gateway records."""
    stream = translation.streaming(CALL_ID)
    assembler = StreamAssembler("chat.completions")
    events: list[bytes] = []
    for chunk in chunks:
        assembler.add(chunk)
        events += stream.chunk(chunk)
    events += stream.done(assembler.response())
    return b"".join(events), assembler.response()


def sse_reply(body: bytes) -> Any:
    return lambda _request: httpx.Response(
        200, content=body, headers={"content-type": "text/event-stream"}
    )


def openai_reading(body: bytes) -> openai.OpenAI:
    transport = httpx.MockTransport(sse_reply(body))
    return openai.OpenAI(
        api_key="k", base_url="http://x/v1", http_client=httpx.Client(transport=transport)
    )


def final_message(body: bytes) -> Any:
    """The Message the `anthropic` SDK's stream accumulator assembles from the events."""
    with anthropic_reading(body).messages.stream(
        model="m", max_tokens=10, messages=[{"role": "user", "content": "hi"}]
    ) as events:
        return events.get_final_message()


def anthropic_reading(body: bytes) -> anthropic.Anthropic:
    def reply(_request: Any) -> httpx2.Response:
        return httpx2.Response(200, content=body, headers={"content-type": "text/event-stream"})

    client = httpx2.Client(transport=httpx2.MockTransport(reply))
    return anthropic.Anthropic(api_key="k", base_url="http://x", http_client=client)


def responses_with_a_tool() -> ResponsesTranslation:
    request = ResponsesRequest.model_validate(
        {"input": "hi", "tools": [{"type": "function", "name": "add", "parameters": ADD}]}
    )
    return ResponsesTranslation(request, [])


def messages_with_a_tool() -> MessagesTranslation:
    request = MessagesRequest.model_validate(
        {
            "max_tokens": 10,
            "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"name": "add", "input_schema": ADD}],
            "stop_sequences": ["END"],
        }
    )
    return MessagesTranslation(request)


@pytest.mark.parametrize("case", list(CASES))
def test_a_responses_stream_assembles_to_the_whole_answer(case: str) -> None:
    deltas, finish, stop = CASES[case]
    translation = responses_with_a_tool()
    body, answer = translated(translation, chat_chunks(deltas, finish, stop))
    with openai_reading(body).responses.stream(model="m", input="hi") as stream:
        events = list(stream)
    whole = translation.answer(answer, CALL_ID)

    # An answer cut by max_output_tokens ends `response.incomplete`, as OpenAI's API does
    # (the SDK's get_final_response() then raises, as it does there).
    ending = "response.incomplete" if finish == "length" else "response.completed"
    assert [events[0].type, events[-1].type] == ["response.created", ending]
    final = events[-1].response  # type: ignore[union-attr]
    got = [o.model_dump(mode="json", by_alias=True) for o in final.output]
    assert without_none(got) == without_none(whole["output"])
    assert final.status == whole["status"]


@pytest.mark.parametrize("case", list(CASES))
def test_a_messages_stream_assembles_to_the_whole_answer(case: str) -> None:
    deltas, finish, stop = CASES[case]
    translation = messages_with_a_tool()
    body, answer = translated(translation, chat_chunks(deltas, finish, stop))
    final = final_message(body)
    whole = translation.answer(answer, CALL_ID)

    got = [b.model_dump(mode="json") for b in final.content]
    assert without_none(got) == without_none(whole["content"])
    assert (final.stop_reason, final.stop_sequence) == (
        whole["stop_reason"],
        whole["stop_sequence"],
    )
    assert final.id == whole["id"] == f"msg_{CALL_ID}"
    if stop:
        assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", "END")


def test_a_stream_that_fails_at_once_says_so_in_each_protocol() -> None:
    """An error before any chunk: the SDKs raise the gateway's message, not a parse error."""
    responses = ResponsesTranslation(ResponsesRequest.model_validate({"input": "hi"}), [])
    body = responses.streaming(CALL_ID).error("call not recorded: engine died", "upstream_error")
    with (
        pytest.raises(openai.APIError, match="engine died"),
        openai_reading(body).responses.stream(model="m", input="hi") as events,
    ):
        list(events)
    request = MessagesRequest.model_validate(
        {"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    )
    body = (
        MessagesTranslation(request)
        .streaming(CALL_ID)
        .error("call not recorded: x", "upstream_error")
    )
    with (
        pytest.raises(anthropic.APIStatusError, match="call not recorded"),
        anthropic_reading(body).messages.stream(
            model="m", max_tokens=4, messages=[{"role": "user", "content": "hi"}]
        ) as stream,
    ):
        list(stream)
    assert json.loads(body.split(b"data: ", 1)[1])["error"]["type"] == "api_error"


def test_text_after_a_tool_call_is_not_streamed() -> None:
    """As vLLM's Hermes parser has it, an answer's text is what came before its first call:
    text after it (here the newline between two calls) reaches neither protocol's agent."""
    deltas = [
        call_delta(0, "call_a", '{"a": 1}'),
        {"content": "\n"},
        call_delta(1, "call_b", '{"a": 2}'),
    ]
    request = ResponsesRequest.model_validate({"input": "hi"})
    body, _ = translated(ResponsesTranslation(request, []), chat_chunks(deltas, "tool_calls", None))
    with openai_reading(body).responses.stream(model="m", input="hi") as stream:
        final = stream.get_final_response()
    assert [o.type for o in final.output] == ["function_call", "function_call"]
    messages = MessagesRequest.model_validate(
        {"max_tokens": 9, "messages": [{"role": "user", "content": "hi"}]}
    )
    body, _ = translated(MessagesTranslation(messages), chat_chunks(deltas, "tool_calls", None))
    with anthropic_reading(body).messages.stream(
        model="m", max_tokens=9, messages=[{"role": "user", "content": "hi"}]
    ) as events:
        message = events.get_final_message()
    assert [b.type for b in message.content] == ["tool_use", "tool_use"]


def arguments_delta(index: int, arguments: str) -> dict[str, Any]:
    return {"tool_calls": [{"index": index, "function": {"arguments": arguments}}]}


TWO_CALLS: dict[str, list[dict[str, Any]]] = {
    # One after the other, each in pieces, as vLLM's parsers stream them.
    "in turn": [
        call_delta(0, "call_a", '{"a": '),
        arguments_delta(0, "1}"),
        call_delta(1, "call_b", '{"a": '),
        arguments_delta(1, "2}"),
    ],
    # The first call's arguments go on after the second call began.
    "interleaved": [
        call_delta(0, "call_a", '{"a": '),
        call_delta(1, "call_b", '{"a": 2'),
        arguments_delta(0, "1}"),
        arguments_delta(1, "}"),
    ],
}


@pytest.mark.parametrize("case", list(TWO_CALLS))
def test_a_messages_stream_with_two_tool_calls_gives_both_whole(case: str) -> None:
    """Anthropic's blocks take no delta once stopped: neither call's arguments are lost, in
    turn or interleaved, and the agent assembles the recorded answer."""
    translation = messages_with_a_tool()
    body, answer = translated(translation, chat_chunks(TWO_CALLS[case], "tool_calls", None))
    final = final_message(body)
    whole = translation.answer(answer, CALL_ID)
    got = [b.model_dump(mode="json") for b in final.content]
    assert without_none(got) == without_none(whole["content"])
    assert [(b["id"], b["input"]) for b in got] == [("call_a", {"a": 1}), ("call_b", {"a": 2})]
    stopped = [
        json.loads(line[6:]) for line in body.decode().splitlines() if '"content_block_' in line
    ]
    for i, event in enumerate(stopped):
        if event["type"] == "content_block_delta":
            # A delta goes to the block last started and not yet stopped.
            opened = [e for e in stopped[:i] if e["type"] == "content_block_start"][-1]["index"]
            closed = {e["index"] for e in stopped[:i] if e["type"] == "content_block_stop"}
            assert event["index"] == opened and opened not in closed


def test_a_messages_stream_sends_a_call_it_never_showed() -> None:
    """A tool call the chat stream never showed (a parser that names it only at the end) still
    reaches the agent, whole, from the recorded answer."""
    translation = messages_with_a_tool()
    stream = translation.streaming(CALL_ID)
    chunks = chat_chunks([{"content": "Let me add."}], "tool_calls", None)
    events = [e for chunk in chunks for e in stream.chunk(chunk)]
    recorded = {
        "id": "c",
        "model": "tiny",
        "prompt_token_ids": [1, 2, 3],
        "choices": [
            {
                "index": 0,
                "finish_reason": "tool_calls",
                "token_ids": [10],
                "message": {
                    "role": "assistant",
                    "content": "Let me add.",
                    "tool_calls": [
                        {
                            "id": "call_z",
                            "type": "function",
                            "function": {"name": "add", "arguments": '{"a": 3}'},
                        }
                    ],
                },
            }
        ],
    }
    final = final_message(b"".join([*events, *stream.done(recorded)]))
    got = [b.model_dump(mode="json") for b in final.content]
    assert without_none(got) == without_none(translation.answer(recorded, CALL_ID)["content"])
    assert [b.type for b in final.content] == ["text", "tool_use"]


def test_an_sse_event_is_split_only_at_line_ends() -> None:
    """A chunk whose text holds U+2028, U+2029 or U+0085 unescaped (as pydantic writes JSON)
    is one data line; CRLF and CR end lines as SSE says."""
    chunk = {"choices": [{"delta": {"content": "a\u2028b\u2029c\x85d"}, "index": 0}]}
    written = json.dumps(chunk, ensure_ascii=False)
    buffer = bytearray(f"data: {written}\n\nid: 1\r\ndata: [DONE]\r\n\n".encode())
    first, second = split_sse(buffer)
    assert json.loads(sse_data(first) or "") == chunk
    assert sse_data(second) == "[DONE]"
