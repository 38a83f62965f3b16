"""An HTTP agent's attempt as one activity (RolloutSpec.revision 2) and the report to the
trainer as a local activity (revision 3), on the time-skipping server with the real rollout
worker: the close's call events come back in await_agent's result, the reward is computed there,
the runner keeps the rollout timeout, the report rides in the last workflow task, and histories
of the releases before still replay."""

from __future__ import annotations

import asyncio
import json
import socket
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from aiohttp.abc import AbstractResolver, ResolveResult
from temporalio.api.enums.v1 import EventType
from temporalio.client import WorkflowFailureError, WorkflowHandle, WorkflowHistory
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Replayer, Worker

from darl.activities.runners.base import AgentRunner
from darl.activities.runners.http import HttpAgentRunner
from darl.activities.worker import RolloutWorkerSettings, build_worker
from darl.deploy.temporal_connection import DATA_CONVERTER
from darl.workflows import search_attributes as sa
from darl.workflows.contracts import (
    CURRENT_REVISION,
    AgentReport,
    HttpAgentSpec,
    ModelCallEvent,
    RewardSpec,
    RolloutResult,
    RolloutSpec,
    RolloutTimeouts,
    rollout_workflow_id,
)
from darl.workflows.rollout_status import RolloutStatus
from darl.workflows.rollout_workflow import RolloutWorkflow
from tests.workflow.collector import CollectorWorkflow
from tests.workflow.test_rollout_workflow import call_event, wait_for_status

TIMEOUT = 60
HISTORIES = Path(__file__).parent / "histories"


def http_spec(rollout_id: str | None = None, **overrides: object) -> RolloutSpec:
    values: dict = {
        "run_id": "wf-test",
        "rollout_id": rollout_id or f"r-{uuid.uuid4().hex[:10]}",
        "group_id": "g",
        "task": {"question": "1+1", "answer": "2"},
        "agent": HttpAgentSpec(url="http://agent.test/rollouts"),
        "reward": RewardSpec(function="numeric_match"),
        "timeouts": RolloutTimeouts(agent_seconds=30, heartbeat_seconds=2),
        "revision": CURRENT_REVISION,
    }
    values.update(overrides)
    return RolloutSpec(**values)


class FakeStack:
    """The agent service and the gateway's admin API, as one scripted HTTP server on loopback
    (`agent.test` and `gateway.test` resolve to it). The close answers with `events`;
    `close_answers` are the answers given first (a lost answer, a torn one), before the real
    one."""

    def __init__(self, events: list[ModelCallEvent]) -> None:
        self.events = events
        self.closes: list[dict] = []
        # The other admin requests: "METHOD path".
        self.admin: list[str] = []
        self.close_answers: list[web.Response] = []
        self.agent_posts = 0
        # Answers the agent service gives first (an outage), before its real one.
        self.agent_answers: list[web.Response] = []
        # The agent answers once this is set (a cleared one holds it: a hung agent).
        self.release = asyncio.Event()
        self.release.set()

    async def handle(self, request: web.Request) -> web.Response:
        path = request.path
        if path.endswith("/close"):
            body = json.loads(await request.read() or b"{}")
            self.closes.append(body)
            if self.close_answers:
                return self.close_answers.pop(0)
            returned = body.get("return_events_up_to", 0) >= len(self.events)
            events = [e.model_dump(mode="json") for e in self.events] if returned else None
            return web.json_response({"closed": True, "events": events, "infra_incidents": []})
        if path.startswith("/admin/rollouts/"):
            self.admin.append(f"{request.method} {path}")
            return web.json_response({"closed": False})
        self.agent_posts += 1
        if self.agent_answers:
            return self.agent_answers.pop(0)
        await self.release.wait()
        return web.json_response({"answer": "2"})


class ToLoopback(AbstractResolver):
    """The test's DNS: every host is the FakeStack's server on 127.0.0.1:`port`."""

    def __init__(self, port: int) -> None:
        self.port = port

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        return [
            ResolveResult(
                hostname=host,
                host="127.0.0.1",
                port=self.port,
                family=socket.AF_INET,
                proto=0,
                flags=socket.AI_NUMERICHOST,
            )
        ]

    async def close(self) -> None:
        return None


@asynccontextmanager
async def serving(stack: FakeStack) -> AsyncIterator[aiohttp.ClientSession]:
    """The stack served on loopback, and a session that reaches it by its test host names."""
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", stack.handle)
    runner = web.AppRunner(app, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        async with aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(resolver=ToLoopback(port))
        ) as session:
            yield session
    finally:
        stack.release.set()  # a held agent answers: nothing is left running at cleanup
        await runner.cleanup()


@asynccontextmanager
async def worker(
    env: WorkflowEnvironment,
    tmp_path: Path,
    stack: FakeStack,
    runners: dict[str, AgentRunner] | None = None,
) -> AsyncIterator[str]:
    queue = f"q-{uuid.uuid4().hex[:8]}"
    settings = RolloutWorkerSettings(
        gateway_url="http://gateway.test",
        token_secret=b"test",
        agents_dir=tmp_path / "agents",
        task_queue=queue,
        admin_key="admin",
    )
    async with (
        serving(stack) as session,
        build_worker(
            env.client, settings, session, runners=runners or {"http": HttpAgentRunner(session)}
        ) as rollout_worker,
        Worker(env.client, task_queue=queue + "-collector", workflows=[CollectorWorkflow]),
    ):
        yield rollout_worker.task_queue


async def start(env: WorkflowEnvironment, s: RolloutSpec, queue: str) -> WorkflowHandle:
    """Started as the trainer starts a rollout: with its search attributes set."""
    return await env.client.start_workflow(
        RolloutWorkflow.run,
        s,
        id=rollout_workflow_id(s.rollout_id),
        task_queue=queue,
        search_attributes=sa.rollout_attributes(s, RolloutStatus.PENDING.value),
    )


def event_types(history: WorkflowHistory) -> list[str]:
    return [EventType.Name(e.event_type) for e in history.events]


def scheduled_activities(history: WorkflowHistory) -> list[str]:
    return [
        e.activity_task_scheduled_event_attributes.activity_type.name
        for e in history.events
        if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED
    ]


async def test_the_close_s_events_and_the_reward_come_back_in_one_activity(
    time_skipping_env: WorkflowEnvironment, tmp_path: Path
) -> None:
    s = http_spec()
    stack = FakeStack([call_event(s, "c0", 0), call_event(s, "c1", 1)])
    async with worker(time_skipping_env, tmp_path, stack) as queue:
        handle = await start(time_skipping_env, s, queue)
        result: RolloutResult = await asyncio.wait_for(handle.result(), TIMEOUT)
        history = await handle.fetch_history()
    assert result.status == RolloutStatus.SUCCEEDED and result.reward == 1.0
    assert result.call_ids == ["c0", "c1"] and result.prompt_tokens == 20
    assert result.duplicate_signals == 0 and result.stale_signals == 0
    assert stack.closes == [
        {"started_at": stack.closes[0]["started_at"], "return_events_up_to": 256}
    ]
    # Opened at the gateway before the agent's POST: its calls then ask Temporal nothing.
    assert stack.admin == [f"POST /admin/rollouts/{s.rollout_id}/attempts/1/open"]
    # One activity, no timer, no signal, no patch marker, one upsert (the final status): 12
    # events (a report to a trainer adds its local activity's marker: 1 more).
    assert scheduled_activities(history) == ["await_agent"]
    types = event_types(history)
    assert "EVENT_TYPE_TIMER_STARTED" not in types
    assert "EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED" not in types
    assert "EVENT_TYPE_MARKER_RECORDED" not in types
    assert types.count("EVENT_TYPE_UPSERT_WORKFLOW_SEARCH_ATTRIBUTES") == 1, types
    assert len(types) == 12, types


async def test_an_attempt_opened_whose_agent_cannot_start_is_closed(
    time_skipping_env: WorkflowEnvironment, tmp_path: Path
) -> None:
    """The reward is checked after the attempt was opened at the gateway (a rollout id that
    ran returns its result whatever its reward now is): one that cannot work fails the rollout
    at once, and the attempt is closed at the gateway, which would otherwise take its calls."""
    s = http_spec(reward=RewardSpec(function="no_such_reward_function"))
    stack = FakeStack([])
    async with worker(time_skipping_env, tmp_path, stack) as queue:
        handle = await start(time_skipping_env, s, queue)
        with pytest.raises(WorkflowFailureError) as failed:
            await asyncio.wait_for(handle.result(), TIMEOUT)
    assert "the reward cannot work" in str(failed.value.cause)
    assert stack.admin == [f"POST /admin/rollouts/{s.rollout_id}/attempts/1/open"]
    assert len(stack.closes) == 1 and stack.agent_posts == 0


async def test_a_failed_try_that_is_retried_leaves_the_attempt_open(
    time_skipping_env: WorkflowEnvironment, tmp_path: Path
) -> None:
    """An agent service that is down fails await_agent's try, which Temporal retries: the
    attempt stays open for the retry (the last try's close: test_rollout_activities)."""
    s = http_spec(max_attempts=1)
    stack = FakeStack([call_event(s, "c0", 0)])
    stack.agent_answers = [web.Response(status=503, text="restarting")]
    async with worker(time_skipping_env, tmp_path, stack) as queue:
        result = await asyncio.wait_for(
            (await start(time_skipping_env, s, queue)).result(), TIMEOUT
        )
    assert result.status == RolloutStatus.SUCCEEDED and stack.agent_posts == 2
    assert len(stack.closes) == 1  # the attempt's own close, after its agent ended


async def test_the_report_to_the_trainer_rides_in_the_last_workflow_task(
    time_skipping_env: WorkflowEnvironment, tmp_path: Path
) -> None:
    """The trainer gets exactly the workflow's result, from the report_rollout local activity
    in the workflow task that completes the rollout: no signal-external, no signalled event,
    no workflow task after it (13 events where revision 2 took 17)."""
    stack = FakeStack([])
    async with worker(time_skipping_env, tmp_path, stack) as queue:
        trainer = await time_skipping_env.client.start_workflow(
            CollectorWorkflow.run,
            1,
            id=f"trainer-{uuid.uuid4().hex[:8]}",
            task_queue=queue + "-collector",
        )
        s = http_spec(report_to=trainer.id)
        stack.events = [call_event(s, "c0", 0)]
        handle = await start(time_skipping_env, s, queue)
        result = await asyncio.wait_for(handle.result(), TIMEOUT)
        reported = await asyncio.wait_for(trainer.result(), TIMEOUT)
        history = await handle.fetch_history()
    assert result.status == RolloutStatus.SUCCEEDED and result.call_ids == ["c0"]
    assert reported == [result.outcome()]
    types = event_types(history)
    assert "EVENT_TYPE_SIGNAL_EXTERNAL_WORKFLOW_EXECUTION_INITIATED" not in types
    assert types.count("EVENT_TYPE_MARKER_RECORDED") == 1
    assert types.count("EVENT_TYPE_WORKFLOW_TASK_COMPLETED") == 2
    assert types[-4:] == [
        "EVENT_TYPE_WORKFLOW_TASK_COMPLETED",
        "EVENT_TYPE_UPSERT_WORKFLOW_SEARCH_ATTRIBUTES",
        "EVENT_TYPE_MARKER_RECORDED",
        "EVENT_TYPE_WORKFLOW_EXECUTION_COMPLETED",
    ], types
    assert len(types) == 13, types


async def test_a_report_to_a_trainer_that_is_gone_does_not_undo_the_rollout(
    time_skipping_env: WorkflowEnvironment, tmp_path: Path
) -> None:
    s = http_spec(report_to="trainer-that-never-ran")
    stack = FakeStack([call_event(s, "c0", 0)])
    async with worker(time_skipping_env, tmp_path, stack) as queue:
        handle = await start(time_skipping_env, s, queue)
        result = await asyncio.wait_for(handle.result(), TIMEOUT)
    assert result.status == RolloutStatus.SUCCEEDED and result.reward == 1.0


async def test_a_retried_close_neither_duplicates_nor_loses_a_call(
    time_skipping_env: WorkflowEnvironment, tmp_path: Path
) -> None:
    """A call signalled while the agent ran is in the close's answer again; the close's first
    answer is lost (the notifier closes again) and its second torn (the activity is retried,
    POSTs the same attempt again and closes a third time): each call is in the result once."""
    s = http_spec()
    stack = FakeStack([call_event(s, "c0", 0), call_event(s, "c1", 1)])
    stack.close_answers = [web.Response(status=503), web.Response(status=200, body=b"{torn")]
    stack.release.clear()
    async with worker(time_skipping_env, tmp_path, stack) as queue:
        handle = await start(time_skipping_env, s, queue)
        await wait_for_status(handle, RolloutStatus.RUNNING)
        await handle.signal(RolloutWorkflow.model_calls, [call_event(s, "c0", 0)])
        await wait_for_status(handle, RolloutStatus.RUNNING, calls=1)
        stack.release.set()
        result = await asyncio.wait_for(handle.result(), TIMEOUT)
    assert result.status == RolloutStatus.SUCCEEDED
    assert result.call_ids == ["c0", "c1"]
    assert result.duplicate_signals == 0
    assert len(stack.closes) == 3 and stack.agent_posts == 2


async def test_the_runner_keeps_the_rollout_timeout_without_a_timer(
    time_skipping_env: WorkflowEnvironment, tmp_path: Path
) -> None:
    s = http_spec(timeouts=RolloutTimeouts(agent_seconds=1, heartbeat_seconds=1))
    stack = FakeStack([])
    stack.release.clear()
    async with worker(time_skipping_env, tmp_path, stack) as queue:
        handle = await start(time_skipping_env, s, queue)
        result = await asyncio.wait_for(handle.result(), TIMEOUT)
        history = await handle.fetch_history()
    assert result.status == RolloutStatus.TIMED_OUT
    assert result.error == "agent did not finish within 1s"  # as the timer's timeout said
    assert result.attempts == 1 and result.reward is None
    assert "EVENT_TYPE_TIMER_STARTED" not in event_types(history)
    assert scheduled_activities(history) == ["await_agent"]


async def test_a_report_that_came_by_signal_is_scored_by_compute_reward(
    time_skipping_env: WorkflowEnvironment, tmp_path: Path
) -> None:
    """await_agent's reward is taken only when it scored exactly what the workflow would: a
    reward the agent posted to its result URL (the function sees it) makes compute_reward
    score again."""
    s = http_spec()
    stack = FakeStack([call_event(s, "c0", 0)])
    stack.release.clear()
    async with worker(time_skipping_env, tmp_path, stack) as queue:
        handle = await start(time_skipping_env, s, queue)
        await wait_for_status(handle, RolloutStatus.RUNNING)
        await handle.signal(RolloutWorkflow.agent_result, AgentReport(attempt=1, reward=0.25))
        stack.release.set()
        result = await asyncio.wait_for(handle.result(), TIMEOUT)
        history = await handle.fetch_history()
    assert result.status == RolloutStatus.SUCCEEDED and result.reward == 1.0
    assert scheduled_activities(history) == ["await_agent", "compute_reward"]


async def test_histories_of_the_release_before_replay() -> None:
    """Recorded by the releases before (revision 1: an HTTP agent scored by compute_reward
    and reported by a signal-external, and a rollout the workflow's timer timed out; revision
    2: the attempt as one activity, reported by a signal-external): they replay on the current
    code, which takes their old command sequence."""
    replayer = Replayer(workflows=[RolloutWorkflow], data_converter=DATA_CONVERTER)
    for name, rollout_id in (
        ("http_rollout_before_patch", "recorded-http"),
        ("timed_out_rollout_before_patch", "recorded-timeout"),
        ("http_rollout_revision_2", "recorded-http-2"),
    ):
        history = WorkflowHistory.from_json(
            rollout_workflow_id(rollout_id), (HISTORIES / f"{name}.json").read_text()
        )
        result = await replayer.replay_workflow(history)
        assert result.replay_failure is None, name
