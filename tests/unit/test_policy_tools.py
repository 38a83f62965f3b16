"""Function tools on the reference policy server, over its real HTTP app: the chat template's
tool rendering (and its old bytes without tools), forced tool calls whole and streamed, the
prompt-extension property of a second turn, /tokenize, and the 400s."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest

from darl.serving.policy_app import create_policy_app
from darl.serving.policy_server import PolicyServer
from darl.serving.tiny_model import SPEC_FILE, build_tokenizer, create_model_dir
from darl.serving.tool_calls import ToolCallStream, split_tool_calls
from tests.serving import served

# The template as it was before tools: messages without tools must render to these bytes.
PLAIN_CHATML = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "days": {"type": "integer"},
        "unit": {"enum": ["c", "f"]},
        "scale": {"type": "number"},
        "hourly": {"type": "boolean"},
    },
    "required": ["city", "days"],
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather.", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}},
]
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
]
TOOL_CHAT = {
    "messages": MESSAGES,
    "tools": TOOLS,
    "return_token_ids": True,
    "logprobs": True,
    "max_tokens": 200,
    "seed": 7,
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return create_model_dir(tmp_path_factory.mktemp("model"))


@pytest.fixture
async def server(model_dir: Path, tmp_path: Path) -> AsyncIterator[PolicyServer]:
    policy = PolicyServer(model_dir, max_batch=8, response_log=tmp_path / "responses.jsonl")
    policy.engine.start()
    yield policy
    await asyncio.to_thread(policy.engine.stop)


@pytest.fixture
async def http(server: PolicyServer, tmp_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    async with (
        served(create_policy_app(server), tmp_path, "policy") as url,
        httpx.AsyncClient(base_url=url, timeout=120) as client,
    ):
        yield client


async def chat(http: httpx.AsyncClient, **fields: Any) -> dict[str, Any]:
    response = await http.post("/v1/chat/completions", json={**TOOL_CHAT, **fields})
    assert response.status_code == 200, response.text
    return response.json()


async def stream_chat(http: httpx.AsyncClient, **fields: Any) -> list[dict[str, Any]]:
    body = {**TOOL_CHAT, **fields, "stream": True}
    chunks = []
    async with http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line.removeprefix("data: ")))
    return chunks


def check_call(call: dict[str, Any], tools: list[dict[str, Any]]) -> dict[str, Any]:
    """The call's arguments, checked against its tool's schema and for canonical bytes."""
    assert call["type"] == "function" and call["id"].startswith("call_")
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    raw = call["function"]["arguments"]
    arguments = json.loads(raw)
    jsonschema.validate(arguments, schemas[call["function"]["name"]])
    assert json.dumps(arguments) == raw
    return arguments


def test_messages_without_tools_render_as_before() -> None:
    tokenizer = build_tokenizer()
    conversations = [
        MESSAGES,
        [{"role": "user", "content": "What is 3 + 4?\n\n"}, {"role": "assistant", "content": "7"}],
        [{"role": "user", "content": " x\t"}],
    ]
    for messages in conversations:
        for generation_prompt in (True, False):
            new, old = (
                tokenizer.apply_chat_template(
                    messages,
                    tokenize=False,
                    add_generation_prompt=generation_prompt,
                    chat_template=template,
                )
                for template in (None, PLAIN_CHATML)
            )
            assert new == old


def test_a_cached_model_dir_gets_todays_template(tmp_path: Path) -> None:
    create_model_dir(tmp_path)
    weights = (tmp_path / "model.safetensors").read_bytes()
    marker = json.loads((tmp_path / SPEC_FILE).read_text())
    (tmp_path / SPEC_FILE).write_text(json.dumps({k: marker[k] for k in list(marker)[:8]}))
    (tmp_path / "chat_template.jinja").write_text(PLAIN_CHATML)
    create_model_dir(tmp_path)
    assert "<tool_call>" in (tmp_path / "chat_template.jinja").read_text()
    assert (tmp_path / "model.safetensors").read_bytes() == weights


def test_tools_are_rendered_in_the_system_block() -> None:
    text = build_tokenizer().apply_chat_template(
        MESSAGES, tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    signature = json.dumps({"type": "function", "function": TOOLS[0]["function"]})
    assert f"<tools>\n{signature}\n" in text
    assert text.count("<|im_start|>system") == 1
    assert text.endswith("<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n")


async def test_a_required_tool_call_is_well_formed_whole_and_streamed(
    http: httpx.AsyncClient, server: PolicyServer, tmp_path: Path
) -> None:
    whole = await chat(http, tool_choice="required")
    choice = whole["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["content"] == "" and len(message["tool_calls"]) == 1
    check_call(message["tool_calls"][0], TOOLS)
    ids = choice["token_ids"]
    assert ids[-1] == server.tokenizer.eos_token_id
    assert len(choice["logprobs"]["content"]) == len(ids)

    chunks = await stream_chat(http, tool_choice="required")
    choices = [c for chunk in chunks for c in chunk["choices"]]
    streamed_ids = [t for c in choices for t in c.get("token_ids", [])]
    entries = [e for c in choices for e in (c["logprobs"] or {}).get("content", [])]
    calls = [t for c in choices for t in c["delta"].get("tool_calls", [])]
    assert streamed_ids == ids  # the same seed, the same tokens
    assert [e["logprob"] for e in entries] == [e["logprob"] for e in choice["logprobs"]["content"]]
    assert [c["finish_reason"] for c in choices if c["finish_reason"]] == ["tool_calls"]
    assert [(c["index"], c["function"]) for c in calls] == [
        (0, message["tool_calls"][0]["function"])
    ]
    assert "".join(c["delta"].get("content") or "" for c in choices) == ""
    logged = [json.loads(line) for line in (tmp_path / "responses.jsonl").read_text().splitlines()]
    assert [line["token_ids"][0] for line in logged] == [ids, ids]


async def test_a_named_tool_choice_calls_that_tool(http: httpx.AsyncClient) -> None:
    named = {"type": "function", "function": {"name": "get_time"}}
    body = await chat(http, tool_choice=named, seed=3)
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop"  # vLLM's and OpenAI's for a named choice
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_time"
    check_call(call, TOOLS)


async def test_a_forced_logprob_is_that_of_the_masked_distribution(
    http: httpx.AsyncClient,
) -> None:
    body = await chat(http, tool_choice="required", top_logprobs=3)
    entries = body["choices"][0]["logprobs"]["content"]
    # "<tool_call>\n{\"name\": \"get_" is forced whatever the model says.
    assert all(e["logprob"] == 0.0 for e in entries[:20])
    assert all(len(e["top_logprobs"]) == 1 for e in entries[:20])


async def test_the_next_turn_extends_the_prompt_and_completion(
    http: httpx.AsyncClient,
) -> None:
    first = await chat(http, tool_choice="required", seed=11)
    choice = first["choices"][0]
    (call,) = choice["message"]["tool_calls"]
    result = {"role": "tool", "tool_call_id": call["id"], "content": "sunny, 21 C"}
    history = first["prompt_token_ids"] + choice["token_ids"]
    for arguments in (call["function"]["arguments"], json.loads(call["function"]["arguments"])):
        # OpenAI's string, and the object an Anthropic client sends back.
        assistant = {
            "role": "assistant",
            "content": None,
            "tool_calls": [{**call, "function": {**call["function"], "arguments": arguments}}],
        }
        second = await chat(http, messages=[*MESSAGES, assistant, result], max_tokens=4)
        prompt = second["prompt_token_ids"]
        assert prompt[: len(history)] == history
        tail = build_tokenizer().decode(prompt[len(history) :])
        assert tail == (
            "\n<|im_start|>user\n<tool_response>\nsunny, 21 C\n</tool_response><|im_end|>\n"
            "<|im_start|>assistant\n"
        )


async def test_a_call_cut_by_max_tokens_is_no_call(http: httpx.AsyncClient) -> None:
    body = await chat(http, tool_choice="required", max_tokens=20)
    choice = body["choices"][0]
    assert choice["finish_reason"] == "length"
    assert choice["message"]["tool_calls"] == []
    assert choice["message"]["content"].startswith("<tool_call>\n")


async def test_tool_choice_none_renders_tools_and_parses_nothing(
    http: httpx.AsyncClient,
) -> None:
    body = await chat(http, tool_choice="none", max_tokens=8)
    assert "tool_calls" not in body["choices"][0]["message"]
    tokens = await http.post("/tokenize", json={"messages": MESSAGES, "tools": TOOLS})
    assert tokens.json()["tokens"] == body["prompt_token_ids"]


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {
                                "type": "object",
                                "properties": {"xs": {"type": "array"}},
                            },
                        },
                    }
                ]
            },
            "unsupported type 'array'",
        ),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {
                                "type": "object",
                                "properties": {"n": {"type": "integer", "minimum": 1}},
                            },
                        },
                    }
                ]
            },
            "unsupported JSON schema keywords ['minimum']",
        ),
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "'nope'"),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "What is this?"},
                            {
                                "type": "image_url",
                                "image_url": {"url": "data:image/png;base64,AAAA"},
                            },
                        ],
                    }
                ]
            },
            "this model takes text only",
        ),
    ],
)
async def test_what_the_server_cannot_serve_is_a_400(
    http: httpx.AsyncClient, fields: dict[str, Any], says: str
) -> None:
    body = {**TOOL_CHAT, "tool_choice": "required", **fields}
    response = await http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400
    assert says in response.json()["error"]["message"]


async def test_tokenize_answers_in_vllms_shape(
    http: httpx.AsyncClient, server: PolicyServer
) -> None:
    chat_prompt = (await chat(http, max_tokens=1))["prompt_token_ids"]
    tokens = (await http.post("/tokenize", json={"messages": MESSAGES, "tools": TOOLS})).json()
    assert tokens["tokens"] == chat_prompt
    assert tokens["count"] == len(chat_prompt)
    assert tokens["max_model_len"] == server.engine.max_model_len
    plain = (await http.post("/tokenize", json={"prompt": "Hi!"})).json()
    assert plain["tokens"] == [44, 19, 63] and plain["count"] == 3
    bad = await http.post("/tokenize", json={"model": "darl-tiny"})
    assert bad.status_code == 400


def test_streamed_text_splits_as_the_whole_text_does() -> None:
    text = (
        'Sure. <tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
        '<tool_call>{"name":"get_weather","arguments":{"city":"Oslo","days":1}}</tool_call>'
        " <tool_call>not json</tool_call> <tool"
    )
    content, calls = split_tool_calls(text)
    # The content is what came before the first call (vLLM's Hermes parser drops the rest).
    assert content == "Sure. "
    assert [c["function"]["arguments"] for c in calls] == ["{}", '{"city":"Oslo","days":1}']
    stream = ToolCallStream()
    pieces = [stream.feed(ch, final=False) for ch in text] + [stream.feed("", final=True)]
    assert "".join(p[0] for p in pieces) == content
    assert [c["function"] for p in pieces for c in p[1]] == [c["function"] for c in calls]
    assert all(not p[0].endswith("<") for p in pieces[:-1])  # a tag's start is held back
    # Before any call, a block that does not parse is content, and an unfinished tag too.
    assert split_tool_calls("a <tool_call>not json</tool_call> <tool") == (
        "a <tool_call>not json</tool_call> <tool",
        [],
    )
