"""A policy server whose stream breaks off (a fake upstream, named so: it stands for a vLLM that
dies mid-answer): the agent gets an error event, never an answer's end, and nothing is stored.
The gateway runs in process against the session's dev server and a real rollout."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from darl.deploy.temporal_connection import TemporalSettings, connect
from darl.gateway.app import GatewaySettings, create_app
from darl.gateway.store import DirectoryTrajectoryStore
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


@pytest.mark.parametrize(
    "ending",
    [b"", b'data: {"error": {"message": "engine died"}}\n\ndata: [DONE]\n\n'],
    ids=["cut-off", "error-event"],
)
async def test_a_broken_stream_ends_in_an_error(
    stack: Stack, tmp_path: Path, ending: bytes
) -> None:
    rollout_id = await stack.start_idle_rollout("broken")
    client = await connect(TemporalSettings(address=stack.env()["TEMPORAL_ADDRESS"]))
    store_dir = tmp_path / "store"
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
                f"{url}/rollouts/{rollout_id}/v1/chat/completions",
                json={"messages": [{"role": "user", "content": "hi"}], "stream": True},
                headers={"Authorization": f"Bearer {stack.token(rollout_id)}"},
            ) as response,
        ):
            events = [line async for line in response.aiter_lines() if line.startswith("data")]
    assert response.status_code == 200
    assert "data: [DONE]" not in events
    last = json.loads(events[-1][6:])
    assert "call not recorded" in last["error"]["message"]
    finishing = [e for e in events[:-1] if '"finish_reason": "' in e]
    assert finishing == []
    assert DirectoryTrajectoryStore(store_dir).read_sync(rollout_id) == []
    await stack.client.get_workflow_handle(f"rollout/{rollout_id}").cancel()
