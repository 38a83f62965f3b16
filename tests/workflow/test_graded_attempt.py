"""A reward from a grader (RewardSpec.grader), on the time-skipping server with the real
rollout activities: await_agent grades the ended attempt with its runner however its agent
ended (unless DARL failed it first), the workflow takes the grade and never what the agent
reported (a result it posted, a reward in its exit: kept as its claim), and a grading that
cannot be done fails the rollout as DARL's, without a retry. The runner is
a stand-in with a scripted grade; tests/integration/test_swe_agents.py grades real sandboxes."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

from aiohttp import web
from temporalio.testing import WorkflowEnvironment

from darl.activities.agent_contract import AgentContract
from darl.activities.runners.base import AgentRunner
from darl.activities.sandbox import GradingError
from darl.workflows.contracts import (
    CURRENT_REVISION,
    AgentExit,
    AgentHandle,
    AgentReport,
    AwaitRequest,
    GradeReport,
    GraderSpec,
    LaunchRequest,
    LocalAgentSpec,
    RewardSpec,
    RolloutResult,
    RolloutSpec,
    RolloutTimeouts,
    SandboxSpec,
)
from darl.workflows.heartbeats import Heartbeat
from darl.workflows.names import AGENT_RESULT_SIGNAL
from darl.workflows.rollout_status import RolloutStatus
from tests.workflow.test_one_activity_attempt import FakeStack, start, worker

TIMEOUT = 60
GRADE = GradeReport(reward=0.0, tests=3, passed=2, failed_tests=["tests/t.py::f"], diff="+x\n")


class ScriptedGradingRunner(AgentRunner):
    """A local runner stand-in: its agent ends at once with exit 0 and reports a reward of 1
    (as a reward-hacking agent would); `grade` answers the scripted verdict."""

    kind = "local"

    def __init__(
        self, grade: GradeReport | GradingError, exits: list[AgentExit] | None = None
    ) -> None:
        self.verdict = grade
        # How each attempt's agent ends (an exit with status 0, by default).
        self.exits = exits or []
        self.grades = 0
        self.started = asyncio.Event()
        # Held until the test has signalled the agent's report, so the report is in the
        # history before the attempt ends.
        self.release = asyncio.Event()

    async def launch(self, request: LaunchRequest, contract: AgentContract) -> AgentHandle:
        return AgentHandle(
            kind=self.kind, rollout_id=request.spec.rollout_id, attempt=request.attempt,
            started_at=0.0,
        )  # fmt: skip

    async def wait(
        self, request: AwaitRequest, contract: AgentContract, heartbeat: Heartbeat
    ) -> AgentExit:
        self.started.set()
        await self.release.wait()
        report = AgentReport(attempt=request.attempt, reward=1.0, answer="fixed")
        if request.attempt <= len(self.exits):
            return self.exits[request.attempt - 1].model_copy(update={"report": report})
        return AgentExit(exit_code=0, report=report)

    async def grade(self, request: AwaitRequest, heartbeat: Heartbeat) -> GradeReport:
        self.grades += 1
        if isinstance(self.verdict, GradingError):
            raise self.verdict
        return self.verdict

    async def kill(self, handle: AgentHandle) -> None:
        return None

    async def stop(self, request: LaunchRequest) -> None:
        return None


def graded_spec() -> RolloutSpec:
    return RolloutSpec(
        run_id="wf-test",
        rollout_id=f"r-{uuid.uuid4().hex[:10]}",
        task={
            "instance_id": "i",
            "repo": "o/r",
            "base_commit": "abc",
            "problem_statement": "p",
            "FAIL_TO_PASS": ["tests/t.py::f"],
            "PASS_TO_PASS": [],
            "test_patch": "hidden",
        },
        agent=LocalAgentSpec(command=["true"], sandbox=SandboxSpec(repos_dir="/repos")),
        reward=RewardSpec(grader=GraderSpec()),
        timeouts=RolloutTimeouts(agent_seconds=30, heartbeat_seconds=2),
        revision=CURRENT_REVISION,
    )


async def run_graded(
    env: WorkflowEnvironment,
    tmp_path: Path,
    runner: ScriptedGradingRunner,
    stack: FakeStack | None = None,
) -> RolloutResult:
    async with worker(env, tmp_path, stack or FakeStack([]), runners={"local": runner}) as queue:
        handle = await start(env, graded_spec(), queue)
        await asyncio.wait_for(runner.started.wait(), TIMEOUT)
        # The agent's own report by signal too: a reward it posted to DARL_RESULT_URL.
        await handle.signal(AGENT_RESULT_SIGNAL, AgentReport(attempt=1, reward=1.0))
        runner.release.set()
        return await asyncio.wait_for(handle.result(), TIMEOUT)


async def test_the_grade_is_the_reward_whatever_the_agent_reports(
    time_skipping_env: WorkflowEnvironment, tmp_path: Path
) -> None:
    runner = ScriptedGradingRunner(GRADE)
    result = await run_graded(time_skipping_env, tmp_path, runner)
    assert result.status == RolloutStatus.SUCCEEDED, result.error
    assert result.reward == 0.0 and result.grade == GRADE
    assert runner.grades == 1
    # What the agent said of itself is kept as its claim, apart from DARL's reward.
    claim = result.agent_claim
    assert claim is not None and (claim.reward, claim.answer) == (1.0, "fixed")
    assert (result.answer, result.metadata) == (None, {})


async def test_an_agent_that_failed_or_ran_out_of_time_is_graded_all_the_same(
    time_skipping_env: WorkflowEnvironment, tmp_path: Path
) -> None:
    """No way of ending spares an agent its grade: killed (137) or timed out, what it left
    is graded, and the rollout succeeds with that grade (a failed_agent or timed_out
    rollout would not be trained: a zero the policy could choose not to count)."""
    for ended in (AgentExit(exit_code=137), AgentExit(exit_code=None, timed_out=True)):
        runner = ScriptedGradingRunner(GRADE, exits=[ended])
        result = await run_graded(time_skipping_env, tmp_path, runner)
        assert result.status == RolloutStatus.SUCCEEDED, result.error
        assert (result.reward, result.grade, result.exit_code) == (0.0, GRADE, ended.exit_code)
        assert runner.grades == 1 and result.attempts == 1


async def test_an_agent_that_failed_after_darl_failed_it_gets_a_new_attempt(
    time_skipping_env: WorkflowEnvironment, tmp_path: Path
) -> None:
    """Rule 7 still holds: an agent that failed after a DARL incident is not graded; its
    attempt is DARL's failure, and the next attempt is graded."""
    stack = FakeStack([])
    stack.close_answers.append(
        web.json_response(
            {"closed": True, "events": [], "infra_incidents": ["502 the policy server failed"]}
        )
    )
    runner = ScriptedGradingRunner(GRADE, exits=[AgentExit(exit_code=1)])
    result = await run_graded(time_skipping_env, tmp_path, runner, stack)
    assert result.status == RolloutStatus.SUCCEEDED, result.error
    assert (result.attempts, result.grade, runner.grades) == (2, GRADE, 1)


async def test_a_grading_that_cannot_be_done_fails_the_rollout_as_darl_s(
    time_skipping_env: WorkflowEnvironment, tmp_path: Path
) -> None:
    runner = ScriptedGradingRunner(GradingError("the hidden test_patch does not apply"))
    result = await run_graded(time_skipping_env, tmp_path, runner)
    assert result.status == RolloutStatus.FAILED_INFRA
    assert result.error == "grading failed: the hidden test_patch does not apply"
    assert result.reward is None and result.grade is None
    assert result.attempts == 1 and runner.grades == 1
