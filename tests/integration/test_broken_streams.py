"""A policy server whose stream breaks off (a fake upstream, named so: it stands for a vLLM that
dies mid-answer): the agent gets an error event in its protocol (chat, Responses, Messages),
never an answer's end; no call is stored, and the failed call is recorded. The gateway runs in
process against the session's dev server and a real rollout."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from darl.deploy.temporal_connection import TemporalSettings, connect
from darl.gateway.app import create_app
from darl.gateway.state import GatewaySettings
from darl.gateway.store.directory import DirectoryTrajectoryStore
from tests.integration.stack import TOKEN_SECRET, Stack
from tests.serving import served

CHUNK = {
    "id": "chatcmpl-x",
    "object": "chat.completion.chunk",
    "created": 0,
    "model": "fake",
    "prompt_token_ids": [1, 2, 3],
    "choices": [
        {"index": 0, "delta": {"content": "ab"}, "token_ids": [4, 5], "finish_reason": None}
    ],
}


def breaking_upstream(ending: bytes) -> Any:
    """Streams two chunks, then `ending` instead of a finished answer."""

    async def app(scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        if scope["path"].endswith("/models"):
            body = json.dumps({"data": [{"id": "fake"}]}).encode()
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-type", b"application/json")],
                }
            )
            await send({"type": "http.response.body", "body": body})
            return
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream")],
            }
        )
        for _ in range(2):
            event = f"data: {json.dumps(CHUNK)}\n\n".encode()
            await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": ending})

    return app


PROTOCOLS = {
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    "responses": ("/v1/responses", {"input": "hi"}),
    "messages": (
        "/v1/messages",
        {"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]},
    ),
}


def error_message(protocol: str, event: dict[str, Any]) -> str:
    if protocol == "responses":
        assert event["type"] == "error"
        return str(event["message"])
    if protocol == "messages":
        assert event["type"] == "error" and event["error"]["type"] == "api_error"
    return str(event["error"]["message"])


@pytest.mark.parametrize("protocol", list(PROTOCOLS))
@pytest.mark.parametrize(
    "ending",
    [b"", b'data: {"error": {"message": "engine died"}}\n\ndata: [DONE]\n\n'],
    ids=["cut-off", "error-event"],
)
async def test_a_broken_stream_ends_in_an_error(
    stack: Stack, tmp_path: Path, ending: bytes, protocol: str
) -> None:
    rollout_id = await stack.start_idle_rollout("broken")
    client = await connect(TemporalSettings(address=stack.env()["TEMPORAL_ADDRESS"]))
    store_dir = tmp_path / "store"
    path, body = PROTOCOLS[protocol]
    async with served(breaking_upstream(ending), tmp_path, "upstream") as upstream:
        gateway = create_app(
            GatewaySettings(
                token_secret=TOKEN_SECRET.encode(), admin_key="a", upstreams=(upstream,)
            ),
            DirectoryTrajectoryStore(store_dir),
            client,
        )
        async with (
            served(gateway, tmp_path, "gateway") as url,
            httpx.AsyncClient() as http,
            http.stream(
                "POST",
                f"{url}/rollouts/{rollout_id}{path}",
                json={**body, "stream": True},
                headers={"Authorization": f"Bearer {stack.token(rollout_id)}"},
            ) as response,
        ):
            events = [line async for line in response.aiter_lines() if line.startswith("data")]
    assert response.status_code == 200
    assert "data: [DONE]" not in events
    assert "call not recorded" in error_message(protocol, json.loads(events[-1][6:]))
    ends = ('"finish_reason": "', "response.completed", "message_stop", "message_delta")
    assert [e for e in events[:-1] if any(end in e for end in ends)] == []
    store = DirectoryTrajectoryStore(store_dir)
    assert store.read_sync(rollout_id) == []
    (failed,) = await store.failed_calls(rollout_id, 1)
    assert (failed.status, failed.protocol) == (502, PROTOCOLS_NAMED[protocol])
    await stack.client.get_workflow_handle(f"rollout/{rollout_id}").cancel()


PROTOCOLS_NAMED = {"chat": "chat.completions", "responses": "responses", "messages": "messages"}
