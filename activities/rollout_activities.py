"""The rollout activities: `launch_agent`, `await_agent`, `compute_reward`, `stop_agent`.

They pick the runner by the agent spec's kind, issue the attempt's agent contract, and close the
attempt at the gateway when its agent has ended: the gateway then refuses stragglers' calls and
hands over the attempt's call events before the workflow scores it. For a workflow that runs an
attempt as one activity (`AwaitRequest.one_activity`, revision 2 on), an attempt is one
await_agent: the close's events come back in its result and a reward function is computed
right there, so Temporal schedules nothing else for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Mapping

from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from temporalio import activity
from temporalio.client import Client, WorkflowExecution, WorkflowExecutionStatus
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError, RPCStatusCode

from darl.activities import rewards
from darl.activities.agent_contract import AgentContract, ContractIssuer, TaskFieldError
from darl.activities.errors import agent_spec_error, reward_spec_error
from darl.activities.gateway_attempts import CLOSE_GIVE_UP_SECONDS, GatewayAttempts
from darl.activities.heartbeats import heartbeating
from darl.activities.runners.base import AgentRunner, agent_heartbeat_interval
from darl.activities.sandbox import GradingError, SandboxSpecError
from darl.activities.sandbox.grading import check_grader
from darl.workflows.contracts import (
    CLOSE_LISTED,
    AgentExit,
    AgentHandle,
    AgentScore,
    AwaitRequest,
    LaunchRequest,
    ModelCallEvent,
    RewardRequest,
    RolloutResult,
    RolloutSpec,
    TrajectorySummary,
    WorkflowAgentSpec,
)
from darl.workflows.names import (
    AWAIT_AGENT,
    COMPUTE_REWARD,
    LAUNCH_AGENT,
    ROLLOUT_ALREADY_RAN_ERROR,
    STOP_AGENT,
)

log = logging.getLogger(__name__)

# The most call events an attempt's close returns in await_agent's result; an attempt with more
# has them signalled by the gateway (a workflow result stays far below Temporal's payload limit).
RETURNED_EVENTS_CAP = 256


def current_traceparent() -> str | None:
    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier)
    return carrier.get("traceparent")


@functools.cache
def _warn_no_visibility() -> None:
    log.warning(
        "this Temporal server has no visibility API (the time-skipping test server?): a "
        "rollout id started again cannot be told from a first start here"
    )


async def earlier_executions(client: Client) -> list[WorkflowExecution]:
    """The other executions of the calling activity's workflow id (the temporal CLI starts a
    closed workflow id again by default). Visibility is eventually consistent on some servers:
    a start within a second of the earlier end may not see it; on a server without a
    visibility API (the time-skipping test server) there is nothing to look in."""
    info = activity.info()
    try:
        executions = [e async for e in client.list_workflows(f'WorkflowId = "{info.workflow_id}"')]
    except RPCError as err:
        if err.status != RPCStatusCode.UNIMPLEMENTED:
            raise
        _warn_no_visibility()
        return []
    return [e for e in executions if e.run_id != info.workflow_run_id]


def _check_reward(spec: RolloutSpec) -> None:
    """Bad input fails fast (rule 9): a reward that cannot score the task (or a grader that
    cannot grade it here) is found before the agent runs, not after it."""
    try:
        rewards.check(spec.reward, spec.task)
        if spec.reward.grader is not None:
            check_grader(spec)
    except (rewards.RewardFunctionError, SandboxSpecError, TaskFieldError) as err:
        raise reward_spec_error(f"the reward cannot work: {err}") from None


async def refuse_a_second_run(client: Client, rollout_id: str) -> None:
    """Rule 7: a rollout id has one result. An execution of a rollout's workflow id that finds
    an earlier one raises a non-retryable RolloutAlreadyRan carrying the earlier result, which
    the workflow returns, instead of re-attaching to the earlier agent's leftovers."""
    workflow_id = activity.info().workflow_id
    if workflow_id is None:
        raise RuntimeError("refuse_a_second_run runs only as a RolloutWorkflow's activity")
    for execution in await earlier_executions(client):
        if execution.status == WorkflowExecutionStatus.COMPLETED:
            handle = client.get_workflow_handle(
                workflow_id, run_id=execution.run_id, result_type=RolloutResult
            )
            result = await handle.result(follow_runs=False)
            raise ApplicationError(
                f"rollout {rollout_id} already ran (run {execution.run_id}): {result.status}",
                result.model_dump(mode="json"),
                type=ROLLOUT_ALREADY_RAN_ERROR,
                non_retryable=True,
            )
        ended = execution.status.name.lower() if execution.status else "unknown"
        raise ApplicationError(
            f"rollout {rollout_id} already ran as run {execution.run_id}, which ended {ended} "
            "without a result; a rollout id runs once: start it under a new rollout id",
            type=ROLLOUT_ALREADY_RAN_ERROR,
            non_retryable=True,
        )


def not_retried(err: Exception) -> bool:
    """Whether Temporal will not retry the running activity after `err`: a non-retryable
    error, or its retry policy's last try."""
    if isinstance(err, ApplicationError) and err.non_retryable:
        return True
    info = activity.info()
    policy = info.retry_policy
    if policy is None:
        return False
    # Temporal matches an error's type, or the class name of an error that has none.
    kind = err.type if isinstance(err, ApplicationError) else type(err).__name__
    if kind in (policy.non_retryable_error_types or ()):
        return True
    return 0 < policy.maximum_attempts <= info.attempt


class RolloutActivities:
    def __init__(
        self,
        runners: Mapping[str, AgentRunner],
        issuer: ContractIssuer,
        client: Client,
        gateway: GatewayAttempts | None = None,
    ) -> None:
        self._runners = dict(runners)
        self._issuer = issuer
        self._client = client
        self._gateway = gateway

    def activities(self) -> list:
        return [
            self.launch_agent,
            self.await_agent,
            self.compute_reward,
            self.stop_agent,
        ]

    @activity.defn(name=LAUNCH_AGENT)
    async def launch_agent(self, request: LaunchRequest) -> AgentHandle:
        """Idempotent per (rollout, attempt): a retry returns the agent already started.
        A reward that cannot work fails it before any agent starts."""
        runner = self._runner(request.spec)
        if request.attempt == 1:
            # A rollout id that already ran returns its result, whatever its reward now is.
            await self._refuse_a_second_run(request.spec.rollout_id)
        async with self._closed_if_not_retried(request.spec.rollout_id, request.attempt):
            _check_reward(request.spec)
            contract = self._contract(
                request.spec, request.attempt, current_traceparent(), request.replay_from
            )
            return await runner.launch(request, contract)

    @activity.defn(name=AWAIT_AGENT)
    async def await_agent(self, request: AwaitRequest) -> AgentExit:
        """Heartbeats while the agent runs; a retry after a worker crash re-attaches to it.
        Cancellation kills the agent before the cancellation completes."""
        runner = self._runner(request.spec)
        # An agent HTTP service has no launch: its attempt starts here.
        starts_here = request.attempt == 1 and request.handle.kind == "http"
        if starts_here:
            await self._refuse_a_second_run(request.spec.rollout_id)
        # A failure Temporal retries leaves the agent running for the retry to re-attach to;
        # past the last try the attempt is over, and its calls are refused.
        async with self._closed_if_not_retried(request.spec.rollout_id, request.attempt):
            if starts_here:
                _check_reward(request.spec)
            contract = self._contract(
                request.spec, request.attempt, current_traceparent(), request.replay_from
            )
            try:
                agent_exit = await runner.wait(request, contract, activity.heartbeat)
            except asyncio.CancelledError:
                details = activity.cancellation_details()
                if activity.is_worker_shutdown() or details is None or not details.cancel_requested:
                    # The worker is stopping, or the server gave up on this try (its
                    # heartbeat timed out while Temporal was unreachable): not the rollout.
                    # Leave the agent running and its attempt open for the retry to
                    # re-attach to.
                    raise
                # Killing can take the kill grace and closing a retry or two: keep
                # heartbeating, or the server would time the activity out before the agent
                # is really gone.
                interval = agent_heartbeat_interval(request.spec.timeouts.heartbeat_seconds)
                await heartbeating(runner.kill(request.handle), interval)
                await heartbeating(
                    self._close_quietly(request.spec.rollout_id, request.attempt), interval
                )
                raise
        agent_exit = await self._closed(request, agent_exit)
        if request.one_activity and request.spec.reward.grader is not None:
            agent_exit = await self._graded(runner, request, agent_exit)
        return agent_exit

    async def _graded(
        self, runner: AgentRunner, request: AwaitRequest, agent_exit: AgentExit
    ) -> AgentExit:
        """The grader's verdict on an attempt whose agent ended (RewardSpec.grader): DARL
        runs it here, on the machine that holds the attempt's sandbox, after the agent and
        its close. However the agent ended (an exit status, the rollout timeout) what it left
        is graded, so no way of ending turns its zero into an attempt that does not count;
        only an agent that failed after DARL failed it (rule 7) is left to a new attempt. A
        grading DARL cannot do (its test patch does not apply, say) is said in
        `grade_error`; anything else fails the try, and the retry grades again from the same
        workspace."""
        failed = agent_exit.exit_code != 0 or agent_exit.timed_out
        if failed and agent_exit.infra_incidents:
            return agent_exit
        try:
            grade = await runner.grade(request, activity.heartbeat)
        except SandboxSpecError as err:
            # Bad input no retry can fix (checked at launch too, rule 9).
            raise reward_spec_error(f"the grader cannot work: {err}") from None
        except GradingError as err:
            log.warning("grading %s/%d failed: %s", request.spec.rollout_id, request.attempt, err)
            return agent_exit.model_copy(update={"grade_error": str(err)})
        return agent_exit.model_copy(update={"grade": grade})

    async def _closed(self, request: AwaitRequest, agent_exit: AgentExit) -> AgentExit:
        """The agent has ended: close its attempt at the gateway (heartbeating: a slow
        gateway must not time the activity out) and, for a workflow that runs an attempt as
        one activity, take the attempt's call events from the close and score it."""
        spec = request.spec
        interval = agent_heartbeat_interval(spec.timeouts.heartbeat_seconds)
        if request.one_activity and agent_exit.timed_out:
            # Nothing to score: the close signals what is pending, and a gateway that cannot
            # be reached does not turn the timeout into a retry.
            await heartbeating(self._close_quietly(spec.rollout_id, request.attempt), interval)
            return agent_exit
        calls: list[ModelCallEvent] | None = []  # no gateway, no calls
        if self._gateway is not None:
            closing = self._gateway.close_attempt(
                spec.rollout_id,
                request.attempt,
                CLOSE_GIVE_UP_SECONDS,
                started_at=request.handle.started_at,
                # Every revision's workflow takes the events of its result as it takes a
                # signal, dropping the ones it has by call id without counting them.
                return_events_up_to=RETURNED_EVENTS_CAP,
                replay_from=request.replay_from,
                prefix=spec.prefix,
            )
            closed = await heartbeating(closing, interval)
            calls = closed.events
            agent_exit = agent_exit.model_copy(
                update={
                    "infra_incidents": closed.incidents[:CLOSE_LISTED],
                    "failed_calls": closed.failed_calls[:CLOSE_LISTED],
                    "failed_call_count": len(closed.failed_calls),
                    "calls": calls or [],
                    "replay": closed.replay,
                }
            )
        if request.one_activity and calls is not None:
            agent_exit = agent_exit.model_copy(
                update={"score": await self._score(request, agent_exit, calls)}
            )
        return agent_exit

    async def _score(
        self, request: AwaitRequest, agent_exit: AgentExit, calls: list[ModelCallEvent]
    ) -> AgentScore | None:
        """The reward of a finished attempt, from the whole trajectory the close returned, with
        what the workflow would score it with had no report come by signal; None when there
        is nothing to score or the function failed unexpectedly (the workflow's
        compute_reward then runs it again, with its own retries and timeout)."""
        spec = request.spec
        if spec.reward.function is None or agent_exit.exit_code != 0 or agent_exit.timed_out:
            return None
        report = agent_exit.report
        answer = report.answer if report is not None else None
        summary = TrajectorySummary.of_calls(
            spec.rollout_id,
            request.attempt,
            calls,
            agent_exit.exit_code,
            report,
            dict(report.metadata) if report is not None else {},
        )
        interval = agent_heartbeat_interval(spec.timeouts.heartbeat_seconds)
        scoring = rewards.score(spec.reward, spec.task, answer, summary)
        try:
            async with asyncio.timeout(spec.timeouts.reward_seconds):
                reward = await heartbeating(scoring, interval)
        except rewards.RewardFunctionError as err:
            return AgentScore(answer=answer, summary=summary, error=str(err))
        except Exception as err:  # noqa: BLE001 - user code; compute_reward reruns it
            log.warning(
                "reward of %s/%d left to compute_reward: %r", spec.rollout_id, request.attempt, err
            )
            return None
        return AgentScore(answer=answer, summary=summary, reward=reward)

    @activity.defn(name=STOP_AGENT)
    async def stop_agent(self, request: LaunchRequest) -> None:
        """Stop an attempt whose launch was cancelled (there may be no handle yet)."""
        try:
            await self._runner(request.spec).stop(request)
        finally:
            # Closed even when stopping failed: the rollout was cancelled either way.
            await self._close_quietly(request.spec.rollout_id, request.attempt)

    @activity.defn(name=COMPUTE_REWARD)
    async def compute_reward(self, request: RewardRequest) -> float:
        try:
            return await rewards.score(
                request.spec.reward, request.spec.task, request.answer, request.summary
            )
        except rewards.RewardFunctionError as err:
            raise ApplicationError(
                str(err), type="RewardFunctionError", non_retryable=True
            ) from err

    async def _refuse_a_second_run(self, rollout_id: str) -> None:
        """Open attempt 1 at the gateway (its calls then cost the server no describe). Only
        an attempt 1 the gateway already closed can be an earlier execution's (or this one's,
        retried after its close): then Temporal's visibility, which costs the server ~10 ms a
        query on the dev server's SQLite, is asked which it was."""
        if self._gateway is None or await self._gateway.open_attempt(rollout_id, 1):
            await refuse_a_second_run(self._client, rollout_id)

    @contextlib.asynccontextmanager
    async def _closed_if_not_retried(self, rollout_id: str, attempt: int) -> AsyncIterator[None]:
        """An attempt whose agent cannot start, or be awaited, is closed at the gateway when
        Temporal will not retry this activity: the gateway took the opening as its word that
        the attempt runs, and would otherwise take calls for a rollout that has ended."""
        try:
            yield
        except Exception as err:
            if not_retried(err):
                await self._close_quietly(rollout_id, attempt)
            raise

    async def _close_quietly(self, rollout_id: str, attempt: int) -> None:
        """Close an attempt that ends without a result to score (cancelled, lost)."""
        if self._gateway is None:
            return
        try:
            await self._gateway.close_attempt(rollout_id, attempt, 10.0)
        except ApplicationError as err:
            log.warning("%s", err)

    def _runner(self, spec: RolloutSpec) -> AgentRunner:
        runner = self._runners.get(spec.agent.kind)
        if runner is None:
            raise agent_spec_error(f"this worker has no {spec.agent.kind!r} agent runner")
        return runner

    def _contract(
        self,
        spec: RolloutSpec,
        attempt: int,
        traceparent: str | None,
        replay_from: list[int],
    ) -> AgentContract:
        try:
            env_map = {} if isinstance(spec.agent, WorkflowAgentSpec) else spec.agent.env_map
            return self._issuer.issue(spec, attempt, traceparent, env_map, replay_from)
        except TaskFieldError as err:
            raise agent_spec_error(str(err)) from err
