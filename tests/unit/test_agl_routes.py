"""Agent Lightning v1.0's routes on the gateway, against a stand-in for Temporal that answers
`describe` (the rollout runs) and records signals: the event route (a reward's other fields
reach the rollout's report, other events are stored with the attempt), the `x-api-key` header,
the mode path segment that takes only `train` and `val`, and a client that goes away while it
sends its request."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from temporalio.client import WorkflowExecutionStatus

from darl.gateway.app import create_app
from darl.gateway.auth import presented_key_from_headers
from darl.gateway.calls.proxy import ProxySettings
from darl.gateway.state import GatewaySettings
from darl.gateway.store.directory import DirectoryTrajectoryStore
from darl.workflows.contracts import AgentReport
from darl.workflows.names import AGENT_RESULT_SIGNAL
from darl.workflows.rollout_token import TokenClaims, mint_token

SECRET = b"secret"
ROLLOUT = "r1"
EVENTS = f"/api/rollouts/{ROLLOUT}/attempt/1/events"


@dataclass
class Description:
    status: WorkflowExecutionStatus = WorkflowExecutionStatus.RUNNING


@dataclass
class FakeTemporal:
    """The two calls the event route makes of Temporal: describe and signal."""

    signals: list[tuple[str, str, Any]] = field(default_factory=list)

    def get_workflow_handle(self, workflow_id: str) -> FakeHandle:
        return FakeHandle(self, workflow_id)


@dataclass
class FakeHandle:
    temporal: FakeTemporal
    workflow_id: str

    async def describe(self) -> Description:
        return Description()

    async def signal(self, name: str, payload: Any) -> None:
        self.temporal.signals.append((self.workflow_id, name, payload))


def token(attempt: int = 1) -> str:
    return mint_token(SECRET, TokenClaims(ROLLOUT, attempt, "train", int(time.time() + 600)))


@pytest.fixture
def temporal() -> FakeTemporal:
    return FakeTemporal()


@pytest.fixture
def store(tmp_path: Path) -> DirectoryTrajectoryStore:
    return DirectoryTrajectoryStore(tmp_path)


@pytest.fixture
async def http(
    temporal: FakeTemporal, store: DirectoryTrajectoryStore
) -> AsyncIterator[httpx.AsyncClient]:
    settings = GatewaySettings(
        token_secret=SECRET,
        admin_key="admin",
        upstreams=("http://127.0.0.1:9",),  # never called: the model name is configured
        proxy=ProxySettings(model="policy"),
    )
    app = create_app(settings, store, temporal)  # type: ignore[arg-type]
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
        yield client


async def test_a_reward_event_keeps_its_other_fields_for_the_rollout(
    http: httpx.AsyncClient, temporal: FakeTemporal
) -> None:
    event = {
        "event_type": "reward",
        "data": {"value": 0.5, "source": "agent", "reason": "partial", "message": "2 of 4"},
    }
    response = await http.post(EVENTS, json=event, headers={"Authorization": f"Bearer {token()}"})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["accepted"] is True and body["event_type"] == "reward"
    assert (body["rollout_id"], body["attempt_id"]) == (ROLLOUT, "1")
    ((_, name, report),) = temporal.signals
    assert name == AGENT_RESULT_SIGNAL
    assert report == AgentReport(
        attempt=1,
        reward=0.5,
        metadata={"source": "agent", "reason": "partial", "message": "2 of 4"},
    )


async def test_other_events_are_stored_with_the_attempt_before_the_answer(
    http: httpx.AsyncClient, temporal: FakeTemporal, store: DirectoryTrajectoryStore
) -> None:
    headers = {"Authorization": f"Bearer {token()}"}
    for step in (1, 2):
        event = {"event_type": "tool_call", "data": {"tool": "calculator", "step": step}}
        response = await http.post(EVENTS, json=event, headers=headers)
        assert response.status_code == 200, response.text
        assert response.json()["accepted"] is True
        assert response.json()["data"] == event["data"]
    assert temporal.signals == []
    # Another store object on the same directory (a gateway that starts later) sees them.
    stored = await DirectoryTrajectoryStore(store.root).events(ROLLOUT, 1)
    assert [(e["event_type"], e["data"]["step"]) for e in stored] == [
        ("tool_call", 1),
        ("tool_call", 2),
    ]
    assert all(isinstance(e["timestamp"], float) for e in stored)
    assert await store.events(ROLLOUT, 2) == []


async def test_a_bad_event_is_a_400_and_is_not_stored(
    http: httpx.AsyncClient, store: DirectoryTrajectoryStore
) -> None:
    headers = {"Authorization": f"Bearer {token()}"}
    response = await http.post(EVENTS, json={"data": {}}, headers=headers)
    assert response.status_code == 400 and "event_type" in response.text
    bad_reward = {"event_type": "reward", "data": {"value": "lots"}}
    assert (await http.post(EVENTS, json=bad_reward, headers=headers)).status_code == 400
    assert await store.events(ROLLOUT, 1) == []


async def test_the_x_api_key_header_carries_the_token_as_the_anthropic_sdk_sends_it(
    http: httpx.AsyncClient, temporal: FakeTemporal
) -> None:
    event = {"event_type": "reward", "data": {"value": 1.0}}
    response = await http.post(EVENTS, json=event, headers={"x-api-key": token()})
    assert response.status_code == 200, response.text
    assert len(temporal.signals) == 1
    assert (await http.post(EVENTS, json=event, headers={"x-api-key": "nope"})).status_code == 401
    assert (await http.post(EVENTS, json=event)).status_code == 401


def test_bearer_comes_first_then_x_api_key() -> None:
    assert presented_key_from_headers({"authorization": "Bearer a", "x-api-key": "b"}) == "a"
    assert presented_key_from_headers({"x-api-key": "b"}) == "b"
    # A scheme other than Bearer (a proxy's Basic auth, say) leaves the key to x-api-key.
    assert presented_key_from_headers({"authorization": "Basic xyz", "x-api-key": "b"}) == "b"
    assert presented_key_from_headers({"authorization": "Basic xyz"}) is None


@pytest.mark.parametrize("mode", ["test", "TRAIN", "eval"])
async def test_the_mode_segment_takes_only_train_and_val(
    http: httpx.AsyncClient, mode: str
) -> None:
    url = f"/proxy/rollout/{ROLLOUT}/attempt/1/mode/{mode}/openai/v1/models"
    response = await http.get(url, headers={"Authorization": f"Bearer {token()}"})
    assert response.status_code == 404, response.text


@pytest.mark.parametrize("mode", ["train", "val"])
async def test_train_and_val_reach_the_route(http: httpx.AsyncClient, mode: str) -> None:
    url = f"/proxy/rollout/{ROLLOUT}/attempt/1/mode/{mode}/openai/v1/models"
    response = await http.get(url, headers={"Authorization": f"Bearer {token()}"})
    assert response.status_code == 200, response.text
    assert [m["id"] for m in response.json()["data"]] == ["policy"]


async def test_a_client_gone_mid_request_is_no_server_error(
    temporal: FakeTemporal, store: DirectoryTrajectoryStore
) -> None:
    """An agent killed while it sends its request: the route reads what came, then the
    disconnect. It is answered 499 (to nobody) as the client's doing, never raised out of the
    app as the server's error (which uvicorn logs as "Exception in ASGI application" with a
    traceback), and nothing of it is signalled or stored."""
    settings = GatewaySettings(
        token_secret=SECRET,
        admin_key="admin",
        upstreams=("http://127.0.0.1:9",),
        proxy=ProxySettings(model="policy"),
    )
    app = create_app(settings, store, temporal)  # type: ignore[arg-type]
    arriving = [
        {"type": "http.request", "body": b'{"event_type": "reward", "da', "more_body": True},
        {"type": "http.disconnect"},
    ]

    async def receive() -> dict[str, Any]:
        return arriving.pop(0) if arriving else {"type": "http.disconnect"}

    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": EVENTS,
        "raw_path": EVENTS.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"host", b"gateway"),
            (b"content-type", b"application/json"),
            (b"content-length", b"4096"),
            (b"authorization", f"Bearer {token()}".encode()),
        ],
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 80),
    }
    await app(scope, receive, send)
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 499
    assert b"client_disconnected" in b"".join(m.get("body", b"") for m in sent[1:])
    assert temporal.signals == [] and await store.events(ROLLOUT, 1) == []
