"""RolloutWorkflow on Temporal's time-skipping test server: signals, timeouts, cancellation,
agent crashes and infra retries. Agents are real processes where the behaviour is the runner's
(timeout kill, crash, cancel); stub activities where the test must steer the timing."""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import psutil
import pytest
from temporalio import activity
from temporalio.api.enums.v1 import EventType
from temporalio.api.sdk.v1 import WorkflowMetadata
from temporalio.client import WorkflowFailureError, WorkflowHandle
from temporalio.exceptions import CancelledError
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from darl.activities.errors import agent_lost_error
from darl.activities.runners.local import stop_leftover_agents
from darl.activities.worker import RolloutWorkerSettings, build_worker
from darl.workflows import search_attributes as sa
from darl.workflows.contracts import (
    AgentExit,
    AgentHandle,
    AgentReport,
    AwaitRequest,
    LaunchRequest,
    LocalAgentSpec,
    ModelCallEvent,
    PrefixSpec,
    RewardSpec,
    RolloutProgress,
    RolloutResult,
    RolloutSpec,
    RolloutTimeouts,
    rollout_workflow_id,
)
from darl.workflows.rollout_status import RolloutStatus
from darl.workflows.rollout_workflow import RolloutWorkflow
from tests.workflow.collector import CollectorWorkflow

TIMEOUT = 60  # no test here should take more than a few seconds


def spec(agent_command: list[str] | None = None, **overrides: object) -> RolloutSpec:
    values: dict = {
        "run_id": "wf-test",
        "rollout_id": f"r-{uuid.uuid4().hex[:10]}",
        "group_id": "g",
        "task": {"question": "1+1", "answer": "2"},
        "agent": LocalAgentSpec(command=agent_command or ["true"]),
        "timeouts": RolloutTimeouts(agent_seconds=30, heartbeat_seconds=2),
    }
    values.update(overrides)
    return RolloutSpec(**values)


def call_event(
    s: RolloutSpec, call_id: str, sequence: int, attempt: int = 1, policy_version: int = 0
) -> ModelCallEvent:
    return ModelCallEvent(
        call_id=call_id,
        rollout_id=s.rollout_id,
        attempt=attempt,
        sequence=sequence,
        endpoint="chat.completions",
        upstream="http://policy",
        policy_version=policy_version,
        prompt_tokens=10,
        completion_tokens=5,
        latency_ms=1.0,
        http_status=200,
        record_ref=f"ref#{sequence}",
    )


class StubAgents:
    """Activities with the real names whose agents the test releases by hand."""

    def __init__(self) -> None:
        self.launches: list[tuple[str, int]] = []
        self.tasks: list[object] = []
        self.release = asyncio.Event()
        self.scoring = asyncio.Event()
        self.lose_attempts: set[int] = set()
        self.exit_report: AgentReport | None = None
        self.launch_gate: asyncio.Event | None = None
        self.stops: list[int] = []
        # How an attempt's agent ends, by attempt (default: exit 0 with `exit_report`).
        self.exits: dict[int, AgentExit] = {}

    @activity.defn(name="launch_agent")
    async def launch_agent(self, request: LaunchRequest) -> AgentHandle:
        self.launches.append((request.spec.rollout_id, request.attempt))
        self.tasks.append(request.spec.task)
        if self.launch_gate is not None:
            await self.launch_gate.wait()
        return AgentHandle(
            kind="stub", rollout_id=request.spec.rollout_id, attempt=request.attempt, started_at=0
        )

    @activity.defn(name="await_agent")
    async def await_agent(self, request: AwaitRequest) -> AgentExit:
        if request.attempt in self.lose_attempts:
            raise agent_lost_error("the stub's machine vanished")
        while not self.release.is_set():
            activity.heartbeat()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.release.wait(), 0.2)
        return self.exits.get(request.attempt, AgentExit(exit_code=0, report=self.exit_report))

    @activity.defn(name="stop_agent")
    async def stop_agent(self, request: LaunchRequest) -> None:
        self.stops.append(request.attempt)

    @activity.defn(name="compute_reward")
    async def compute_reward(self, request: object) -> float:
        self.scoring.set()
        await self.release.wait()
        return 0.5


@asynccontextmanager
async def stub_worker(env: WorkflowEnvironment, stubs: StubAgents) -> AsyncIterator[str]:
    queue = f"q-{uuid.uuid4().hex[:8]}"
    async with Worker(
        env.client,
        task_queue=queue,
        workflows=[RolloutWorkflow, CollectorWorkflow],
        activities=[
            stubs.launch_agent,
            stubs.await_agent,
            stubs.compute_reward,
            stubs.stop_agent,
        ],
    ):
        yield queue


@asynccontextmanager
async def real_worker(
    env: WorkflowEnvironment, tmp_path: Path, admin_key: str | None = None
) -> AsyncIterator[str]:
    queue = f"q-{uuid.uuid4().hex[:8]}"
    settings = RolloutWorkerSettings(
        gateway_url="http://127.0.0.1:9",  # agents here make no model calls; nothing listens
        token_secret=b"test",
        agents_dir=tmp_path / "agents",
        task_queue=queue,
        admin_key=admin_key,
    )
    async with (
        build_worker(env.client, settings) as worker,
        Worker(env.client, task_queue=queue + "-collector", workflows=[CollectorWorkflow]),
    ):
        try:
            yield worker.task_queue
        finally:
            stop_leftover_agents(tmp_path / "agents", grace_seconds=1)


async def start(env: WorkflowEnvironment, s: RolloutSpec, queue: str):
    return await env.client.start_workflow(
        RolloutWorkflow.run, s, id=rollout_workflow_id(s.rollout_id), task_queue=queue
    )


async def wait_until(predicate, timeout: float = 20) -> None:
    """Poll a condition on files or lists the test cannot be notified about."""
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.05)


async def wait_for_status(
    handle: WorkflowHandle, status: RolloutStatus, calls: int = 0
) -> RolloutProgress:
    """Poll the `status` query (what the workflow has processed) until the rollout is in
    `status` with at least `calls` calls."""
    async with asyncio.timeout(TIMEOUT):
        while True:
            progress = await handle.query(RolloutWorkflow.status)
            if progress.status == status and progress.calls >= calls:
                return progress
            await asyncio.sleep(0.05)


async def wait_for_cancel_request(handle: WorkflowHandle) -> None:
    """Poll the history until the workflow has asked its activity to cancel."""
    async with asyncio.timeout(TIMEOUT):
        while True:
            history = await handle.fetch_history()
            if any(
                e.HasField("activity_task_cancel_requested_event_attributes")
                for e in history.events
            ):
                return
            await asyncio.sleep(0.05)


async def current_details(handle: WorkflowHandle) -> str:
    """What the Web UI's workflow page shows as Current Details (it asks the same query)."""
    async with asyncio.timeout(TIMEOUT):
        metadata = await handle.query("__temporal_workflow_metadata", result_type=WorkflowMetadata)
    return metadata.current_details


def agent_pid(tmp_path: Path, s: RolloutSpec, attempt: int = 1) -> int:
    handle = tmp_path / "agents" / s.rollout_id / f"attempt-{attempt}" / "handle.json"
    return json.loads(handle.read_text())["data"]["pid"]


async def test_calls_and_report_make_the_result(time_skipping_env: WorkflowEnvironment) -> None:
    stubs = StubAgents()
    s = spec()
    async with stub_worker(time_skipping_env, stubs) as queue:
        handle = await start(time_skipping_env, s, queue)
        await wait_until(lambda: stubs.launches)
        await wait_for_status(handle, RolloutStatus.RUNNING)
        await handle.signal(RolloutWorkflow.model_calls, [call_event(s, "b", sequence=1)])
        await handle.signal(
            RolloutWorkflow.model_calls,
            [call_event(s, "a", sequence=0), call_event(s, "a", sequence=0)],  # a duplicate
        )
        await handle.signal(RolloutWorkflow.model_calls, [call_event(s, "z", 0, attempt=7)])
        await handle.signal(RolloutWorkflow.agent_result, AgentReport(attempt=1, reward=0.75))
        await handle.signal(RolloutWorkflow.agent_result, AgentReport(attempt=1, answer="two"))
        progress = await handle.query(RolloutWorkflow.status)
        assert progress.status == RolloutStatus.RUNNING
        assert progress.calls == 2
        stubs.release.set()
        result: RolloutResult = await asyncio.wait_for(handle.result(), TIMEOUT)
    assert result.status == RolloutStatus.SUCCEEDED
    assert result.reward == 0.75  # a later report keeps what it does not override
    assert result.answer == "two"
    assert result.calls == 2 and result.prompt_tokens == 20 and result.completion_tokens == 10
    assert result.call_ids == ["a", "b"]  # in sequence order, not arrival order
    assert result.duplicate_signals == 1
    assert result.stale_signals == 1


async def test_a_service_reply_keeps_what_the_agent_reported(
    time_skipping_env: WorkflowEnvironment,
) -> None:
    """An HTTP agent may post its reward to DARL_RESULT_URL and reply with its answer only."""
    stubs = StubAgents()
    stubs.exit_report = AgentReport(answer="four", metadata={"turns": 2})
    s = spec()
    async with stub_worker(time_skipping_env, stubs) as queue:
        handle = await start(time_skipping_env, s, queue)
        await wait_for_status(handle, RolloutStatus.RUNNING)
        await handle.signal(RolloutWorkflow.agent_result, AgentReport(attempt=1, reward=0.5))
        stubs.release.set()
        result = await asyncio.wait_for(handle.result(), TIMEOUT)
    assert result.status == RolloutStatus.SUCCEEDED
    assert (result.reward, result.answer, result.metadata) == (0.5, "four", {"turns": 2})


@pytest.mark.parametrize("task", ["What is 1 + 1?", [1, "+", 1], 11])
async def test_a_task_of_any_json_kind_runs_and_a_reward_event_keeps_its_fields(
    time_skipping_env: WorkflowEnvironment, task: object
) -> None:
    stubs = StubAgents()
    s = spec(task=task)
    async with stub_worker(time_skipping_env, stubs) as queue:
        handle = await start(time_skipping_env, s, queue)
        await wait_for_status(handle, RolloutStatus.RUNNING)
        # What the gateway signals for `{"event_type": "reward", "data": {"value": 1.0,
        # "source": "agent", "reason": "exact"}}`.
        reported = AgentReport(
            attempt=1, reward=1.0, metadata={"source": "agent", "reason": "exact"}
        )
        await handle.signal(RolloutWorkflow.agent_result, reported)
        stubs.release.set()
        result = await asyncio.wait_for(handle.result(), TIMEOUT)
    assert stubs.tasks == [task]
    assert result.status == RolloutStatus.SUCCEEDED and result.reward == 1.0
    assert result.metadata == {"source": "agent", "reason": "exact"}


async def test_a_gone_trainer_does_not_fail_the_rollout(
    time_skipping_env: WorkflowEnvironment,
) -> None:
    stubs = StubAgents()
    stubs.release.set()
    async with stub_worker(time_skipping_env, stubs) as queue:
        finished = await time_skipping_env.client.execute_workflow(
            CollectorWorkflow.run, 0, id=f"gone-{uuid.uuid4().hex[:8]}", task_queue=queue
        )
        assert finished == []
        s = spec(
            report_to=f"never-started-{uuid.uuid4().hex[:8]}", reward=RewardSpec(missing_reward=0.0)
        )
        result = await asyncio.wait_for(
            (await start(time_skipping_env, s, queue)).result(), TIMEOUT
        )
    assert result.status == RolloutStatus.SUCCEEDED


async def test_a_finished_rollout_reports_to_its_trainer(
    time_skipping_env: WorkflowEnvironment,
) -> None:
    """Each rollout's report arrives once, with the result the rollout returned."""
    stubs = StubAgents()
    stubs.release.set()
    env = time_skipping_env
    async with stub_worker(env, stubs) as queue:
        collector = await env.client.start_workflow(
            CollectorWorkflow.run, 2, id=f"trainer-{uuid.uuid4().hex[:8]}", task_queue=queue
        )
        specs = [
            spec(report_to=collector.id, reward=RewardSpec(missing_reward=0.5)) for _ in range(2)
        ]
        handles = [await start(env, s, queue) for s in specs]
        results = [await asyncio.wait_for(h.result(), TIMEOUT) for h in handles]
        reported = await asyncio.wait_for(collector.result(), TIMEOUT)
    assert sorted(r.rollout_id for r in reported) == sorted(s.rollout_id for s in specs)
    assert {r.rollout_id: r for r in reported} == {r.rollout_id: r.outcome() for r in results}


async def test_cancelling_while_launching_stops_what_the_launch_starts(
    time_skipping_env: WorkflowEnvironment,
) -> None:
    stubs = StubAgents()
    stubs.launch_gate = asyncio.Event()
    env = time_skipping_env
    async with stub_worker(env, stubs) as queue:
        handle = await start(env, spec(), queue)
        await wait_until(lambda: stubs.launches)
        await handle.cancel()
        await wait_for_cancel_request(handle)
        stubs.launch_gate.set()  # the launch finishes after the cancellation
        with pytest.raises(WorkflowFailureError) as failure:
            await asyncio.wait_for(handle.result(), TIMEOUT)
    assert isinstance(failure.value.cause, CancelledError)
    assert stubs.stops == [1]


async def test_a_call_after_the_agent_ended_stays_out(
    time_skipping_env: WorkflowEnvironment,
) -> None:
    stubs = StubAgents()
    s = spec(reward=RewardSpec(function="numeric_match"))
    async with stub_worker(time_skipping_env, stubs) as queue:
        handle = await start(time_skipping_env, s, queue)
        await wait_until(lambda: stubs.launches)
        await handle.signal(RolloutWorkflow.model_calls, [call_event(s, "in-time", 0)])
        await wait_for_status(handle, RolloutStatus.RUNNING, calls=1)
        stubs.release.set()
        await asyncio.wait_for(stubs.scoring.wait(), TIMEOUT)
        stubs.release.clear()  # hold the scoring step while a late call arrives
        await handle.signal(RolloutWorkflow.model_calls, [call_event(s, "late", 1)])
        await handle.signal(RolloutWorkflow.agent_result, AgentReport(attempt=1, reward=9.0))
        stubs.release.set()
        result = await asyncio.wait_for(handle.result(), TIMEOUT)
    assert result.status == RolloutStatus.SUCCEEDED
    assert result.call_ids == ["in-time"]
    assert result.stale_signals == 2
    assert result.reward == 0.5  # the reward function's, not the late report's


async def test_an_infra_failure_gets_a_new_attempt(time_skipping_env: WorkflowEnvironment) -> None:
    stubs = StubAgents()
    stubs.lose_attempts = {1}
    stubs.release.set()
    s = spec(
        reward=RewardSpec(missing_reward=0.0),
        timeouts=RolloutTimeouts(agent_seconds=30, heartbeat_seconds=2, retry_backoff_seconds=600),
    )
    async with stub_worker(time_skipping_env, stubs) as queue:
        handle = await start(time_skipping_env, s, queue)
        result = await asyncio.wait_for(handle.result(), TIMEOUT)  # the 600 s backoff is skipped
    assert [a for _, a in stubs.launches] == [1, 2]
    assert result.status == RolloutStatus.SUCCEEDED
    assert result.attempts == 2
    assert result.reward == 0.0


async def test_an_infra_failure_on_the_last_attempt_is_the_result(
    time_skipping_env: WorkflowEnvironment,
) -> None:
    stubs = StubAgents()
    stubs.lose_attempts = {1, 2}
    s = spec(max_attempts=2, timeouts=RolloutTimeouts(retry_backoff_seconds=1))
    async with stub_worker(time_skipping_env, stubs) as queue:
        result = await asyncio.wait_for(
            (await start(time_skipping_env, s, queue)).result(), TIMEOUT
        )
    assert result.status == RolloutStatus.FAILED_INFRA
    assert "vanished" in (result.error or "")
    assert result.reward is None


async def test_cancelling_during_the_retry_backoff(time_skipping_env: WorkflowEnvironment) -> None:
    stubs = StubAgents()
    stubs.lose_attempts = {1}
    s = spec(timeouts=RolloutTimeouts(retry_backoff_seconds=3600))
    async with stub_worker(time_skipping_env, stubs) as queue:
        handle = await start(time_skipping_env, s, queue)
        await wait_until(lambda: stubs.launches)
        with time_skipping_env.auto_time_skipping_disabled():
            # Attempt 1 lost, waiting out the backoff.
            await wait_for_status(handle, RolloutStatus.FAILED_INFRA)
            await handle.cancel()
            with pytest.raises(WorkflowFailureError) as failure:
                await asyncio.wait_for(handle.result(), TIMEOUT)
            final = await handle.query(RolloutWorkflow.status)
    assert isinstance(failure.value.cause, CancelledError)
    assert final.status == RolloutStatus.CANCELLED
    assert [a for _, a in stubs.launches] == [1]


async def test_the_rollout_timeout_kills_the_agent(
    time_skipping_env: WorkflowEnvironment, tmp_path: Path
) -> None:
    s = spec(["sleep", "60"], timeouts=RolloutTimeouts(agent_seconds=2, heartbeat_seconds=1))
    async with real_worker(time_skipping_env, tmp_path) as queue:
        result = await asyncio.wait_for(
            (await start(time_skipping_env, s, queue)).result(), TIMEOUT
        )
    assert result.status == RolloutStatus.TIMED_OUT
    assert result.reward is None
    assert not psutil.pid_exists(agent_pid(tmp_path, s)) or (
        psutil.Process(agent_pid(tmp_path, s)).status() == psutil.STATUS_ZOMBIE
    )


async def test_a_slow_cleanup_after_the_timeout_is_still_a_timeout(
    time_skipping_env: WorkflowEnvironment, tmp_path: Path
) -> None:
    """Closing the attempt at an unreachable gateway takes ~10 s, far past the 1 s heartbeat
    timeout: the rollout must still end timed out after one attempt, not be retried."""
    s = spec(["sleep", "60"], timeouts=RolloutTimeouts(agent_seconds=2, heartbeat_seconds=1))
    async with real_worker(time_skipping_env, tmp_path, admin_key="admin") as queue:
        result = await asyncio.wait_for(
            (await start(time_skipping_env, s, queue)).result(), TIMEOUT
        )
    assert result.status == RolloutStatus.TIMED_OUT
    assert result.attempts == 1
    assert not (tmp_path / "agents" / s.rollout_id / "attempt-2").exists()


async def test_a_crashed_agent_fails_with_its_log(
    time_skipping_env: WorkflowEnvironment, tmp_path: Path
) -> None:
    s = spec(["sh", "-c", "echo boom >&2; exit 3"], reward=RewardSpec(missing_reward=1.0))
    async with real_worker(time_skipping_env, tmp_path) as queue:
        result = await asyncio.wait_for(
            (await start(time_skipping_env, s, queue)).result(), TIMEOUT
        )
    assert result.status == RolloutStatus.FAILED_AGENT
    assert result.exit_code == 3
    assert result.reward is None  # never a silent reward, not even missing_reward
    assert "boom" in (result.error or "")
    assert result.attempts == 1


async def test_an_agent_without_a_reward_is_not_given_one(
    time_skipping_env: WorkflowEnvironment, tmp_path: Path
) -> None:
    async with real_worker(time_skipping_env, tmp_path) as queue:
        result = await asyncio.wait_for(
            (await start(time_skipping_env, spec(), queue)).result(), TIMEOUT
        )
    assert result.status == RolloutStatus.FAILED_AGENT
    assert result.error == "agent finished without a reward"


async def test_an_agent_that_cannot_start_is_not_retried(
    time_skipping_env: WorkflowEnvironment, tmp_path: Path
) -> None:
    s = spec(["no-such-agent-binary"])
    async with real_worker(time_skipping_env, tmp_path) as queue:
        result = await asyncio.wait_for(
            (await start(time_skipping_env, s, queue)).result(), TIMEOUT
        )
    assert result.status == RolloutStatus.FAILED_AGENT
    assert result.attempts == 1
    assert "not on PATH" in (result.error or "")


async def test_cancelling_kills_the_agent_and_reports(
    time_skipping_env: WorkflowEnvironment, tmp_path: Path
) -> None:
    collector_id = f"collector-{uuid.uuid4().hex[:8]}"
    async with real_worker(time_skipping_env, tmp_path) as queue:
        collector = await time_skipping_env.client.start_workflow(
            CollectorWorkflow.run, 1, id=collector_id, task_queue=queue + "-collector"
        )
        s = spec(["sleep", "60"], report_to=collector_id)
        handle = await start(time_skipping_env, s, queue)
        agent_dir = tmp_path / "agents" / s.rollout_id / "attempt-1"
        await wait_until(lambda: (agent_dir / "handle.json").exists())
        pid = agent_pid(tmp_path, s)
        assert psutil.pid_exists(pid)
        await handle.cancel()
        with pytest.raises(WorkflowFailureError) as failure:
            await asyncio.wait_for(handle.result(), TIMEOUT)
        assert isinstance(failure.value.cause, CancelledError)
        reported = await asyncio.wait_for(collector.result(), TIMEOUT)
    assert [r.status for r in reported] == [RolloutStatus.CANCELLED]
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


async def test_a_branch_cancelled_mid_attempt_counts_its_prefix_as_the_prefix(
    time_skipping_env: WorkflowEnvironment, tmp_path: Path
) -> None:
    """A branch cancelled before its attempt's close (at the run's end): no close says how
    many calls reproduced the prefix, so the workflow counts those replayed from another
    rollout's calls. Its result must not read as a resumption (replayed, no prefix calls),
    which the trainer counts in `rollouts_resumed` and `calls_replayed`."""
    collector_id = f"collector-{uuid.uuid4().hex[:8]}"
    async with real_worker(time_skipping_env, tmp_path) as queue:
        collector = await time_skipping_env.client.start_workflow(
            CollectorWorkflow.run, 1, id=collector_id, task_queue=queue + "-collector"
        )
        s = spec(
            ["sleep", "60"],
            report_to=collector_id,
            prefix=PrefixSpec(rollout_id="the-seed", calls=2),
        )
        handle = await start(time_skipping_env, s, queue)
        await wait_for_status(handle, RolloutStatus.RUNNING)
        replayed = [
            call_event(s, "a", 0).model_copy(update={"replayed_from": "seed-call-0"}),
            call_event(s, "b", 1).model_copy(update={"replayed_from": "seed-call-1"}),
            call_event(s, "c", 2),
        ]
        await handle.signal(RolloutWorkflow.model_calls, replayed)
        await wait_for_status(handle, RolloutStatus.RUNNING, calls=3)
        await handle.cancel()
        with pytest.raises(WorkflowFailureError):
            await asyncio.wait_for(handle.result(), TIMEOUT)
        (reported,) = await asyncio.wait_for(collector.result(), TIMEOUT)
    assert reported.status == RolloutStatus.CANCELLED
    assert (reported.replayed_calls, reported.prefix_calls) == (2, 2)


async def test_the_web_ui_shows_the_task_status_and_reward(
    time_skipping_env: WorkflowEnvironment,
) -> None:
    """The starter's static summary names the task; the current details follow the status,
    the calls and, once scored, the reward."""
    stubs = StubAgents()
    s = spec()
    async with stub_worker(time_skipping_env, stubs) as queue:
        handle = await time_skipping_env.client.start_workflow(
            RolloutWorkflow.run,
            s,
            id=rollout_workflow_id(s.rollout_id),
            task_queue=queue,
            static_summary=sa.rollout_summary(s),
        )
        await wait_for_status(handle, RolloutStatus.RUNNING)
        running = await current_details(handle)
        await handle.signal(
            RolloutWorkflow.model_calls,
            [call_event(s, "a", 0, policy_version=0), call_event(s, "b", 1, policy_version=1)],
        )
        await wait_for_status(handle, RolloutStatus.RUNNING, calls=2)
        with_calls = await current_details(handle)
        await handle.signal(RolloutWorkflow.agent_result, AgentReport(attempt=1, reward=0.75))
        stubs.release.set()
        result = await asyncio.wait_for(handle.result(), TIMEOUT)
        finished = await current_details(handle)  # a closed workflow's, replayed by the worker
        summary = await (await handle.describe()).static_summary()
    task = '`{"question": "1+1", "answer": "2"}`'
    assert summary == f"train · {task}"
    assert running == f"**running** · attempt 1 of 3 · 0 calls · policy v0\n\ntrain · {task}"
    assert with_calls.startswith("**running** · attempt 1 of 3 · 2 calls · policy v1\n\n")
    assert result.status == RolloutStatus.SUCCEEDED
    assert finished.startswith("**succeeded** · reward 0.75 · attempt 1 of 3 · 2 calls")


async def test_the_details_of_a_failed_rollout_say_why(
    time_skipping_env: WorkflowEnvironment,
) -> None:
    stubs = StubAgents()
    stubs.lose_attempts = {1}
    s = spec(max_attempts=1)
    async with stub_worker(time_skipping_env, stubs) as queue:
        handle = await start(time_skipping_env, s, queue)
        result = await asyncio.wait_for(handle.result(), TIMEOUT)
        details = await current_details(handle)
    assert result.status == RolloutStatus.FAILED_INFRA
    status_line, error_line, _task = details.split("\n\n")
    assert status_line == "**failed_infra** · attempt 1 of 1 · 0 calls · policy v0"
    assert "vanished" in error_line


@pytest.mark.parametrize(
    "task", ["x" * 1000, "é" * 1000, {"q": "`" * 500}, "line one\n\n  line two"]
)
def test_a_summary_is_one_line_within_the_servers_limit(task: object) -> None:
    summary = sa.rollout_summary(spec(task=task))
    assert len(summary.encode()) <= 200  # the server refuses a start with a longer one
    assert "\n" not in summary and summary.count("`") == 2


async def test_darl_policy_version_is_the_version_of_the_last_call(
    time_skipping_env: WorkflowEnvironment,
) -> None:
    """A rollout started at version 1 whose later calls were served by versions 2 and 3 ends
    with DarlPolicyVersion 3, the version of its last call (highest sequence, whatever order
    the calls arrived in), published with the final status, not an upsert per call."""
    stubs = StubAgents()
    s = spec(policy_version=1, reward=RewardSpec(missing_reward=1.0))
    async with stub_worker(time_skipping_env, stubs) as queue:
        handle = await start(time_skipping_env, s, queue)
        await wait_for_status(handle, RolloutStatus.RUNNING)
        for sequence, version in ((0, 1), (2, 3), (1, 2)):
            await handle.signal(
                RolloutWorkflow.model_calls,
                [call_event(s, f"c{sequence}", sequence, policy_version=version)],
            )
        await wait_for_status(handle, RolloutStatus.RUNNING, calls=3)
        while_running = (await handle.describe()).typed_search_attributes
        stubs.release.set()
        result = await asyncio.wait_for(handle.result(), TIMEOUT)
        finished = (await handle.describe()).typed_search_attributes
        history = await handle.fetch_history()
    assert while_running.get(sa.POLICY_VERSION) == 1  # the calls cost no upsert
    assert result.status == RolloutStatus.SUCCEEDED and result.policy_versions == [1, 2, 3]
    assert finished.get(sa.POLICY_VERSION) == 3
    assert finished.get(sa.STATUS) == RolloutStatus.SUCCEEDED.value
    upserts = [
        e
        for e in history.events
        if e.event_type == EventType.EVENT_TYPE_UPSERT_WORKFLOW_SEARCH_ATTRIBUTES
    ]
    assert len(upserts) == 3  # the start's attributes, running, succeeded: as before
