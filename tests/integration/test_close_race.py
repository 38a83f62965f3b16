"""A close that races a late call (rule 1): the gateway has looked at the attempt's closed mark
and is about to write the call when the worker's close arrives. The gateway runs in process
(real HTTP, the stack's real policy server, a real rollout on the session's dev server) over
a directory store and over the S3 emulator, with the store's append held right after the
gateway's look, until the close has answered. The call is refused with the "attempt ended"
error the agent gets for an ended attempt, and is not in the close's answer; its answer, which
the policy server generated, is kept after the close's calls marked unreceived (no part of the
attempt's trajectory), for the next attempt's replay (issue 45)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from darl.deploy.temporal_connection import TemporalSettings, connect
from darl.gateway.app import create_app
from darl.gateway.calls.replay import offered_calls
from darl.gateway.state import GatewaySettings
from darl.gateway.store.base import TrajectoryStore
from darl.gateway.store.directory import DirectoryTrajectoryStore
from darl.gateway.store.record import CallRecord
from darl.gateway.store.s3 import S3TrajectoryStore
from darl.workflows.contracts import rollout_workflow_id
from tests.integration.stack import TOKEN_SECRET, Stack
from tests.serving import served

pytestmark = pytest.mark.integration

ADMIN = "close-race-admin"
WAIT_SECONDS = 60
PROMPT = {"model": "m", "prompt": "1+1=", "max_tokens": 2}


class Hold:
    """Holds the next append, once armed, until released: `reached` says it is held."""

    def __init__(self) -> None:
        self.armed = False
        self.reached = asyncio.Event()
        self.release = asyncio.Event()

    async def wait(self) -> None:
        if not self.armed:
            return
        self.armed = False
        self.reached.set()
        await asyncio.wait_for(self.release.wait(), WAIT_SECONDS)


class HeldDirectory(DirectoryTrajectoryStore):
    def __init__(self, root: Path, hold: Hold) -> None:
        super().__init__(root)
        self.hold = hold

    async def append(self, record: CallRecord) -> CallRecord:
        await self.hold.wait()
        return await super().append(record)


class HeldS3(S3TrajectoryStore):
    def __init__(self, bucket: str, hold: Hold) -> None:
        super().__init__(bucket, "darl")
        self.hold = hold

    async def append(self, record: CallRecord) -> CallRecord:
        await self.hold.wait()
        return await super().append(record)


@pytest.fixture(params=["directory", "s3"])
def held_store(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[TrajectoryStore, Hold]:
    hold = Hold()
    if request.param == "directory":
        return HeldDirectory(tmp_path / "store", hold), hold
    return HeldS3(request.getfixturevalue("s3_bucket"), hold), hold


@pytest.fixture
async def gateway(
    stack: Stack, held_store: tuple[TrajectoryStore, Hold], tmp_path: Path
) -> AsyncIterator[str]:
    client = await connect(TemporalSettings(address=stack.env()["TEMPORAL_ADDRESS"]))
    app = create_app(
        GatewaySettings(
            token_secret=TOKEN_SECRET.encode(), admin_key=ADMIN, upstreams=(stack.policy_url,)
        ),
        held_store[0],
        client,
    )
    async with served(app, tmp_path, "gateway") as url:
        yield url


async def test_a_call_held_between_the_closed_check_and_its_write_is_refused_not_recorded(
    stack: Stack, gateway: str, held_store: tuple[TrajectoryStore, Hold]
) -> None:
    store, hold = held_store
    rollout_id = await stack.start_idle_rollout("close-race")
    calls = f"{gateway}/rollouts/{rollout_id}/v1/completions"
    agent = {"Authorization": f"Bearer {stack.token(rollout_id)}"}
    async with httpx.AsyncClient(timeout=WAIT_SECONDS) as http:
        first = await http.post(calls, json=PROMPT, headers=agent)
        assert first.status_code == 200, first.text
        hold.armed = True
        late = asyncio.create_task(http.post(calls, json=PROMPT, headers=agent))
        await asyncio.wait_for(hold.reached.wait(), WAIT_SECONDS)
        closed = await http.post(
            f"{gateway}/admin/rollouts/{rollout_id}/attempts/1/close",
            json={"return_events_up_to": 256},
            headers={"Authorization": f"Bearer {ADMIN}"},
        )
        hold.release.set()
        answer = await late
    assert closed.status_code == 200, closed.text
    closed_calls = [event["call_id"] for event in closed.json()["events"]]
    assert closed_calls == [first.headers["x-darl-call-id"]]
    # Refused as an ended attempt's call is, never answered as if recorded.
    assert answer.status_code == 409, answer.text
    assert "has ended" in answer.json()["error"]["message"]
    # What the close read is what the store keeps received; the late answer follows it,
    # unreceived, and the next attempt is offered both.
    kept = await store.read(rollout_id, 1)
    assert [r.call_id for r in kept if not r.unreceived] == closed_calls
    assert [r.unreceived for r in kept] == [False, True]
    offered = await offered_calls(store, rollout_id, [1])
    assert [r.call_id for r in offered] == [r.call_id for r in kept]
    await stack.client.get_workflow_handle(rollout_workflow_id(rollout_id)).cancel()
