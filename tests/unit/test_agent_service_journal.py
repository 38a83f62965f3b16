"""The example agent service's attempt journal, over real HTTP and a real SQLite file: an
attempt POSTed again gets the run already under way, a finished attempt POSTed after a restart
gets its stored reply, one the service lost in a restart gets 410 and never runs again, and
without a state directory it still works in memory. Then DARL's HTTP runner against such
services: what each reply means for the attempt."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import pytest
from fastapi import FastAPI, HTTPException
from fastapi.responses import JSONResponse
from temporalio.exceptions import ApplicationError

from darl.activities.agent_contract import ContractIssuer
from darl.activities.runners.http import HttpAgentRunner
from darl.examples.agent_service import (
    LOST,
    STATE_DIR_ENV,
    AgentService,
    Reply,
    RolloutRequest,
    service_app,
)
from darl.workflows.contracts import (
    REPORT_MAX_BYTES,
    AgentHandle,
    AwaitRequest,
    HttpAgentSpec,
    RolloutSpec,
    RolloutTimeouts,
)
from darl.workflows.names import AGENT_LOST_ERROR
from tests.serving import served

WAIT = 10.0


class CountingService(AgentService):
    """Counts its runs and the requests it handled; a run waits for `release` (set unless
    `hold`). `task["fail"]` makes the run fail: "http" with an HTTPException(500), "crash"
    with a plain exception, "huge" with an answer over a report's budget. A reply names the
    run that made it."""

    def __init__(self, state_dir: Path | None, hold: bool = False) -> None:
        super().__init__(state_dir=state_dir)
        self.solved = 0
        self.handled = 0
        self.requests: list[RolloutRequest] = []
        self.entered = asyncio.Event()
        self.release = asyncio.Event()
        if not hold:
            self.release.set()

    async def handle(self, request: RolloutRequest, key: str) -> Reply:
        self.handled += 1
        return await super().handle(request, key)

    async def solve(self, request: RolloutRequest) -> dict[str, Any]:
        self.solved += 1
        run = self.solved
        self.requests.append(request)
        self.entered.set()
        await self.release.wait()
        fail = request.task.get("fail")
        if fail == "http":
            raise HTTPException(500, "the model gave up")
        if fail == "crash":
            raise ValueError("boom")
        if fail == "huge":
            return {"answer": "x" * (REPORT_MAX_BYTES + 1), "reward": 1.0}
        return {"answer": f"{request.task['q']} by run {run}", "reward": 1.0}


@contextlib.asynccontextmanager
async def serving(service: AgentService, tmp: Path, name: str) -> AsyncIterator[httpx.AsyncClient]:
    """The service's app behind a real uvicorn; its journal is closed on exit (the process
    is gone)."""
    try:
        async with (
            served(service_app(service, name), tmp, name) as url,
            httpx.AsyncClient(base_url=url, timeout=WAIT) as client,
        ):
            yield client
    finally:
        if service.journal is not None:
            service.journal.close()


def body(rollout: str = "r1", attempt: int = 1, **task: Any) -> dict[str, Any]:
    return {
        "rollout_id": rollout,
        "attempt": attempt,
        "task": {"q": "2+2", **task},
        "openai_base_url": "http://gateway.test/v1",
        "api_key": "token",
    }


async def post(
    client: httpx.AsyncClient, key: str, rollout: str = "r1", attempt: int = 1, **task: Any
) -> httpx.Response:
    return await client.post(
        "/rollouts", json=body(rollout, attempt, **task), headers={"Idempotency-Key": key}
    )


async def until(condition: Any, seconds: float = WAIT) -> None:
    async with asyncio.timeout(seconds):
        while not condition():
            await asyncio.sleep(0.01)


async def lose_attempt(state_dir: Path, tmp: Path, key: str) -> None:
    """A service accepts the attempt and dies while its agent runs."""
    service = CountingService(state_dir, hold=True)
    async with serving(service, tmp, "dying") as client:
        request = asyncio.create_task(post(client, key))
        await asyncio.wait_for(service.entered.wait(), WAIT)
        service.runs[key].cancel()  # the process dies mid-run: no reply is ever stored
        with contextlib.suppress(httpx.HTTPError):
            response = await asyncio.wait_for(request, WAIT)
            assert response.status_code != 200


async def test_an_attempt_posted_again_while_it_runs_gets_the_same_run(tmp_path: Path) -> None:
    service = CountingService(tmp_path / "state", hold=True)
    async with serving(service, tmp_path, "agent") as client:
        first = asyncio.create_task(post(client, "r1/1"))
        await asyncio.wait_for(service.entered.wait(), WAIT)
        again = asyncio.create_task(post(client, "r1/1"))
        await until(lambda: service.handled == 2)  # the second POST is waiting on the run
        service.release.set()
        a, b = await asyncio.wait_for(asyncio.gather(first, again), WAIT)
    assert service.solved == 1
    assert a.status_code == b.status_code == 200
    assert a.json() == b.json() == {"answer": "2+2 by run 1", "reward": 1.0}


async def test_attempts_posted_twice_at_once_get_one_run_each(tmp_path: Path) -> None:
    service = CountingService(tmp_path / "state")
    keys = [f"r{i}/1" for i in range(8)]
    async with serving(service, tmp_path, "agent") as client:
        replies = await asyncio.wait_for(
            asyncio.gather(*(post(client, key) for key in keys for _ in range(2))), WAIT
        )
    for a, b in zip(replies[::2], replies[1::2], strict=True):
        assert (a.status_code, b.status_code) == (200, 200)
        assert a.json() == b.json()
    assert service.solved == len(keys)


async def test_a_finished_attempt_posted_after_a_restart_gets_its_stored_reply(
    tmp_path: Path,
) -> None:
    state = tmp_path / "state"
    before = CountingService(state)
    async with serving(before, tmp_path, "before") as client:
        answered = await post(client, "r1/1")
    assert answered.status_code == 200 and before.solved == 1
    after = CountingService(state)  # a restart: a new service on the same state dir
    async with serving(after, tmp_path, "after") as client:
        replayed = await post(client, "r1/1")
        fresh = await post(client, "r2/1", rollout="r2")
    assert (replayed.status_code, replayed.json()) == (200, answered.json())
    assert after.solved == 1  # only the new attempt ran
    assert fresh.status_code == 200 and fresh.json()["answer"] == "2+2 by run 1"
    assert [r.rollout_id for r in after.requests] == ["r2"]


async def test_an_attempt_lost_in_a_restart_gets_410_and_never_runs_again(
    tmp_path: Path,
) -> None:
    state = tmp_path / "state"
    await lose_attempt(state, tmp_path, "r1/1")
    after = CountingService(state)
    async with serving(after, tmp_path, "after") as client:
        lost = await post(client, "r1/1")
        lost_again = await post(client, "r1/1")
        fresh = await post(client, "r1/2", attempt=2)
    assert lost.status_code == lost_again.status_code == LOST == 410
    assert "r1/1 was running when this agent service stopped" in lost.json()["detail"]
    assert fresh.status_code == 200
    assert after.solved == 1 and [r.attempt for r in after.requests] == [2]


@pytest.mark.parametrize(
    ("fail", "detail"),
    [("http", "the model gave up"), ("crash", "the agent crashed: ValueError('boom')")],
)
async def test_a_failed_run_replies_500_and_that_reply_is_replayed_after_a_restart(
    tmp_path: Path, fail: str, detail: str
) -> None:
    state = tmp_path / "state"
    before = CountingService(state)
    async with serving(before, tmp_path, "before") as client:
        failed = await post(client, "r1/1", fail=fail)
        again = await post(client, "r1/1", fail=fail)
    assert (failed.status_code, failed.json()) == (500, {"detail": detail})
    assert (again.status_code, again.json()) == (500, {"detail": detail})
    after = CountingService(state)
    async with serving(after, tmp_path, "after") as client:
        replayed = await post(client, "r1/1", fail=fail)
    assert (replayed.status_code, replayed.json()) == (500, {"detail": detail})
    assert before.solved == 1 and after.solved == 0


async def test_without_a_state_dir_attempts_are_remembered_in_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(STATE_DIR_ENV, raising=False)
    service = CountingService(None)
    assert service.journal is None
    async with serving(service, tmp_path, "agent") as client:
        first = await post(client, "r1/1")
        again = await post(client, "r1/1")
        other = await post(client, "r1/2", attempt=2)
    assert first.status_code == again.status_code == other.status_code == 200
    assert first.json() == again.json() == {"answer": "2+2 by run 1", "reward": 1.0}
    assert other.json()["answer"] == "2+2 by run 2"
    assert service.solved == 2
    assert list(tmp_path.rglob("*.sqlite")) == []


async def test_the_state_dir_can_come_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(STATE_DIR_ENV, str(tmp_path / "from-env"))
    before = CountingService(None)
    async with serving(before, tmp_path, "before") as client:
        answered = await post(client, "r1/1")
    assert (tmp_path / "from-env" / "attempts.sqlite").is_file()
    after = CountingService(None)
    async with serving(after, tmp_path, "after") as client:
        replayed = await post(client, "r1/1")
    assert replayed.json() == answered.json() and after.solved == 0


# --- DARL's HTTP runner against a served agent service -------------------------------------

ISSUER = ContractIssuer("http://gateway.test", b"secret")


async def run_attempt(
    url: str,
    rollout: str = "r1",
    attempt: int = 1,
    client: aiohttp.ClientSession | None = None,
    task: dict[str, Any] | None = None,
) -> Any:
    """What the await_agent activity does with an http agent: POST the attempt and wait
    (through `client` when given, as a worker sharing its session does)."""
    spec = RolloutSpec(
        run_id="run1",
        rollout_id=rollout,
        task=task or {"q": "7*6"},
        agent=HttpAgentSpec(url=f"{url}/rollouts"),
        timeouts=RolloutTimeouts(agent_seconds=30, heartbeat_seconds=3),
    )
    handle = AgentHandle(
        kind="http", rollout_id=rollout, attempt=attempt, started_at=time.time(), data={}
    )
    contract = ISSUER.issue(spec, attempt, None, {})
    runner = HttpAgentRunner(client)
    try:
        request = AwaitRequest(spec=spec, attempt=attempt, handle=handle)
        return await asyncio.wait_for(runner.wait(request, contract, lambda *_: None), WAIT)
    finally:
        await runner.aclose()


async def test_the_runner_takes_a_200_as_the_agents_report(tmp_path: Path) -> None:
    service = CountingService(tmp_path / "state")
    async with serving(service, tmp_path, "agent") as client:
        done = await run_attempt(str(client.base_url))
    assert done.exit_code == 0
    assert done.report is not None
    assert (done.report.answer, done.report.reward) == ("7*6 by run 1", 1.0)
    (request,) = service.requests
    assert (request.rollout_id, request.attempt) == ("r1", 1)
    assert request.openai_base_url == "http://gateway.test/rollouts/r1/v1"
    assert request.api_key.startswith("darl")


async def test_a_report_over_its_budget_is_the_agents_failure(tmp_path: Path) -> None:
    """A reply whose answer is over a report's budget is refused as the agent's failure (it
    would travel in Temporal payloads), with the reason in its log, nothing of it kept."""
    service = CountingService(tmp_path / "state")
    async with serving(service, tmp_path, "agent") as client:
        done = await run_attempt(str(client.base_url), task={"q": "7*6", "fail": "huge"})
    assert done.exit_code == 1 and done.report is None
    assert "a report holds at most 65,536" in done.log_tail, done.log_tail[:300]


async def test_an_agent_outlasting_the_clients_read_timeout_is_posted_once(
    tmp_path: Path,
) -> None:
    """The POST waits as long as the agent runs, whatever the client's own timeout (a worker
    that shares its client made every attempt longer than that a retry POSTing it again)."""
    service = CountingService(tmp_path / "state", hold=True)
    async with (
        serving(service, tmp_path, "agent") as served_client,
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.2, sock_read=0.2)) as short,
    ):
        attempt = asyncio.create_task(run_attempt(str(served_client.base_url), client=short))
        await asyncio.wait_for(service.entered.wait(), WAIT)
        await asyncio.sleep(1.0)  # five read timeouts of the client
        service.release.set()
        done = await attempt
    assert done.exit_code == 0 and service.handled == 1 and service.solved == 1


async def test_the_runner_takes_a_500_as_the_agents_failure(tmp_path: Path) -> None:
    class Failing(CountingService):
        async def solve(self, request: RolloutRequest) -> dict[str, Any]:
            raise HTTPException(500, "the model gave up")

    async with serving(Failing(tmp_path / "state"), tmp_path, "agent") as client:
        done = await run_attempt(str(client.base_url))
    assert done.exit_code == 1 and done.report is None
    assert "HTTP 500" in done.log_tail and "the model gave up" in done.log_tail


async def test_the_runner_fails_an_attempt_the_service_lost_as_agent_lost(
    tmp_path: Path,
) -> None:
    state = tmp_path / "state"
    await lose_attempt(state, tmp_path, "r1/1")  # the runner's key: <rollout>/<attempt>
    after = CountingService(state)
    async with serving(after, tmp_path, "after") as client:
        with pytest.raises(ApplicationError) as lost:
            await run_attempt(str(client.base_url))
    assert lost.value.type == AGENT_LOST_ERROR == "AgentLostError"
    assert lost.value.non_retryable
    assert "lost the attempt" in str(lost.value)
    assert after.solved == 0


async def test_the_runner_retries_when_the_service_is_unavailable(tmp_path: Path) -> None:
    front = FastAPI()

    @front.post("/rollouts")
    async def unavailable() -> JSONResponse:
        return JSONResponse({"detail": "no agent pods ready"}, status_code=503)

    async with served(front, tmp_path, "front") as url:
        with pytest.raises(ApplicationError) as unreachable:
            await run_attempt(url)
    assert unreachable.value.type == "AgentServiceUnavailable"
    assert not unreachable.value.non_retryable
    assert "503" in str(unreachable.value)


async def test_the_runner_retries_when_no_service_listens() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # free once closed: nothing listens there
    with pytest.raises(ApplicationError) as unreachable:
        await run_attempt(f"http://127.0.0.1:{port}")
    assert unreachable.value.type == "AgentServiceUnavailable"
    assert not unreachable.value.non_retryable
