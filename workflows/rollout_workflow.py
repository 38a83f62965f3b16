"""RolloutWorkflow: one agent rollout, durable from launch to reward.

Reads as the story of a rollout: launch the agent, await it under the rollout timeout, score it,
tell the trainer. An infra failure (launch failed, agent lost with its worker's machine) gets a
fresh attempt, which resumes by replay of the calls the lost one recorded (rule 10); what the
agent itself did (non-zero exit, timeout, no reward) is the result.

What the server does per rollout bounds rollouts per second, so an attempt of an HTTP agent is
one activity: await_agent enforces the timeout and returns the calls the gateway's close handed
over and the reward it computed; and the report to the trainer is a local activity in the last
workflow task, which the worker batches with other rollouts'. Which command sequence a rollout
runs is its `RolloutSpec.revision`: the table in workflows/contracts/revisions.py.
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.exceptions import ActivityError, CancelledError, FailureError

with workflow.unsafe.imports_passed_through():
    from pydantic import ValidationError

    from darl.workflows.contracts import (
        LOCAL_REPORT_REVISION,
        ONE_ACTIVITY_REVISION,
        AgentExit,
        AgentHandle,
        AgentReport,
        AwaitRequest,
        HttpAgentSpec,
        LaunchRequest,
        ModelCallEvent,
        RewardRequest,
        RolloutProgress,
        RolloutReport,
        RolloutResult,
        RolloutSpec,
        TrajectorySummary,
        WorkflowAgentSpec,
    )
    from darl.workflows.names import (
        AGENT_RESULT_SIGNAL,
        AGENT_SPEC_ERROR,
        AWAIT_AGENT,
        COMPUTE_REWARD,
        LAUNCH_AGENT,
        MODEL_CALLS_SIGNAL,
        REPORT_ROLLOUT,
        ROLLOUT_FINISHED_SIGNAL,
        ROLLOUT_WORKFLOW,
        STATUS_QUERY,
        STOP_AGENT,
    )
    from darl.workflows.rollout_activity_options import (
        AWAIT_RETRY,
        LAUNCH_RETRY,
        REPORT_RETRIES,
        REPORT_TRY_TIMEOUT,
        REWARD_RETRY,
        RUNNER_DEADLINE_GRACE,
        STOP_RETRY,
    )
    from darl.workflows.rollout_agent_workflow import run_agent_workflow
    from darl.workflows.rollout_history import no_room_for_another_attempt
    from darl.workflows.rollout_identity import EarlierRunError, check_workflow_id
    from darl.workflows.rollout_inbox import merged
    from darl.workflows.rollout_outcomes import (
        RewardFailedError,
        cause_of,
        error_type,
        exit_message,
        incidents_message,
        raise_if_cancelled,
        raise_if_the_rollout_ends,
        reward_computed_at_close,
        timeout_message,
    )
    from darl.workflows.rollout_replay import ReplayLineage
    from darl.workflows.rollout_state import RolloutState
    from darl.workflows.rollout_status import TRANSITIONS, IllegalTransitionError, RolloutStatus


# A ValidationError is input no retry can fix (a RolloutSpec the temporal CLI sent that does
# not validate): the workflow fails at once with pydantic's message (rule 9).
@workflow.defn(
    name=ROLLOUT_WORKFLOW, failure_exception_types=[IllegalTransitionError, ValidationError]
)
class RolloutWorkflow:
    @workflow.init
    def __init__(self, spec: RolloutSpec) -> None:
        self._spec = spec
        self._state = RolloutState(spec)
        self._replay_lineage = ReplayLineage(spec.resume)
        # The command sequence the spec's revision asks for (workflows/contracts/revisions.py).
        self._one_activity = spec.revision >= ONE_ACTIVITY_REVISION
        self._local_report = spec.revision >= LOCAL_REPORT_REVISION

    # --- the story ---------------------------------------------------------------------

    @workflow.run
    async def run(self, spec: RolloutSpec) -> RolloutResult:
        check_workflow_id(spec.rollout_id)
        started = workflow.now()
        state = self._state
        state.publish_start()
        try:
            for attempt in range(1, spec.max_attempts + 1):
                retry = await self._run_attempt(attempt)
                if not retry or attempt == spec.max_attempts:
                    break
                # Rule 12: no attempt that could carry the history past Temporal's limit.
                if (no_room := no_room_for_another_attempt(attempt)) is not None:
                    state.findings.error = f"{state.findings.error}; {no_room}"
                    break
                self._replay_lineage.extend(attempt)
                await workflow.sleep(timedelta(seconds=spec.timeouts.retry_backoff_seconds))
        except EarlierRunError as earlier:
            # No agent ran: the earlier execution's result is the rollout's one result, and
            # it is not reported again.
            state.show_earlier_result(earlier.result)
            return earlier.result
        except asyncio.CancelledError:
            if state.status == RolloutStatus.LAUNCHING or (
                state.status == RolloutStatus.RUNNING and isinstance(spec.agent, WorkflowAgentSpec)
            ):
                # A workflow agent's child is cancelled with the rollout; its attempt is
                # closed here, as await_agent closes a killed agent's.
                await self._stop_launched_agent()
            if RolloutStatus.CANCELLED in TRANSITIONS[state.status]:
                state.finish_as(RolloutStatus.CANCELLED, "rollout was cancelled")
                await self._report(state.result(started))
            raise
        result = state.result(started)
        await self._report(result)
        return result

    async def _run_attempt(self, attempt: int) -> bool:
        """Run one attempt to its end. Returns True when it failed for infra reasons."""
        state = self._state
        state.start_attempt(attempt)
        try:
            handle = await self._launch(attempt)
        except ActivityError as err:
            raise_if_the_rollout_ends(err)
            if error_type(err) == AGENT_SPEC_ERROR:
                state.finish_as(RolloutStatus.FAILED_AGENT, f"agent cannot start: {cause_of(err)}")
                return False
            return state.infra_failure(f"launching the agent failed: {cause_of(err)}")
        state.move_to(RolloutStatus.RUNNING)
        ended = None
        if isinstance(self._spec.agent, WorkflowAgentSpec):
            # The agent is a workflow: the rollout runs it as its child and awaits it here;
            # await_agent then closes the attempt and scores it (its input without the token).
            ended = await run_agent_workflow(self._spec, handle)
            handle = handle.model_copy(update={"data": {}})
        try:
            agent_exit = await self._await_agent(handle, ended)
            if agent_exit is not None:
                # Delivered by the close instead of a signal: taken like one.
                state.take_calls(agent_exit.calls, by_signal=False)
                state.findings.replay = agent_exit.replay
        except ActivityError as err:
            raise_if_the_rollout_ends(err)
            return state.infra_failure(f"lost the agent: {cause_of(err)}")
        finally:
            state.inbox.close()
        if agent_exit is None:
            state.finish_as(RolloutStatus.TIMED_OUT, timeout_message(self._spec))
            return False
        return await self._score(attempt, agent_exit)

    async def _launch(self, attempt: int) -> AgentHandle:
        agent = self._spec.agent
        if isinstance(agent, HttpAgentSpec):
            # An agent HTTP service has nothing to launch: the attempt starts with the POST in
            # await_agent. Skipping the activity saves the server a quarter of its work per
            # rollout, which is what bounds rollouts per second.
            return AgentHandle(
                kind=agent.kind,
                rollout_id=self._spec.rollout_id,
                attempt=attempt,
                started_at=workflow.time(),
                data={"url": agent.url},
            )
        handle: AgentHandle = await workflow.execute_activity(
            LAUNCH_AGENT,
            LaunchRequest(
                spec=self._spec, attempt=attempt, replay_from=self._replay_lineage.attempts
            ),
            result_type=AgentHandle,
            start_to_close_timeout=timedelta(seconds=self._spec.timeouts.launch_seconds),
            retry_policy=LAUNCH_RETRY,
        )
        return handle

    async def _stop_launched_agent(self) -> None:
        """Cancelled while launching: the launch may still start the agent, so stop it by its
        attempt (the runner refuses a launch that comes after this)."""
        try:
            await workflow.execute_activity(
                STOP_AGENT,
                LaunchRequest(spec=self._spec, attempt=self._state.attempt),
                start_to_close_timeout=timedelta(seconds=self._spec.timeouts.launch_seconds),
                retry_policy=STOP_RETRY,
            )
        except ActivityError as err:
            workflow.logger.warning("could not stop the agent being launched: %s", cause_of(err))

    async def _await_agent(
        self, handle: AgentHandle, ended: AgentExit | None = None
    ) -> AgentExit | None:
        """The agent's exit (timed out if the runner ended it at the rollout timeout), or None
        when the workflow's own timer fired first (agent killed; without `_one_activity`).
        `ended`: how an agent the workflow awaited itself ended (a workflow agent)."""
        timeouts = self._spec.timeouts
        agent_timeout = timedelta(seconds=timeouts.agent_seconds)
        margin = RUNNER_DEADLINE_GRACE
        if self._one_activity:
            margin += timedelta(seconds=timeouts.reward_seconds)
        waiting = workflow.start_activity(
            AWAIT_AGENT,
            AwaitRequest(
                spec=self._spec,
                attempt=handle.attempt,
                handle=handle,
                one_activity=self._one_activity,
                replay_from=self._replay_lineage.attempts,
                ended=ended,
            ),
            result_type=AgentExit,
            start_to_close_timeout=agent_timeout + margin,
            heartbeat_timeout=timedelta(seconds=timeouts.heartbeat_seconds),
            retry_policy=AWAIT_RETRY,
            # Cancelling waits until the runner has really killed the agent.
            cancellation_type=workflow.ActivityCancellationType.WAIT_CANCELLATION_COMPLETED,
        )
        # With one activity the runner's deadline is the rollout timeout, kept by the
        # activity's start-to-close and heartbeat timeouts if its worker dies: no timer.
        waits: list[asyncio.Future[Any]] = [waiting]
        deadline = None
        if not self._one_activity:
            deadline = asyncio.ensure_future(workflow.sleep(agent_timeout))
            waits.append(deadline)
        try:
            await workflow.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            # The rollout is cancelled: the agent is killed before the cancellation completes.
            if deadline is not None:
                deadline.cancel()
            await self._cancel_agent(waiting)
            raise
        if waiting.done():
            if deadline is not None:
                deadline.cancel()
            agent_exit: AgentExit | None = waiting.result()
            return agent_exit
        return await self._cancel_agent(waiting)

    @staticmethod
    async def _cancel_agent(waiting: asyncio.Future[AgentExit]) -> AgentExit | None:
        """Cancel await_agent and wait until the runner has killed the agent. An agent that
        finished in the same instant still counts as finished. The activity ending any other
        way once cancelled (its heartbeat lost while killing) still ends the attempt: a
        timed-out or cancelled rollout never turns into a retry."""
        waiting.cancel()
        try:
            return await waiting
        except ActivityError as err:
            if not isinstance(err.cause, CancelledError):
                workflow.logger.warning(
                    "await_agent ended badly while cancelled: %s", cause_of(err)
                )
        return None

    async def _score(self, attempt: int, agent_exit: AgentExit) -> bool:
        """Score the attempt. Returns True when it failed for infra reasons: an agent that
        failed while DARL was unavailable to it gets a fresh attempt (rule 7)."""
        state, findings = self._state, self._state.findings
        report = merged(state.inbox.report(attempt), agent_exit.report)
        reward_spec = self._spec.reward
        findings.take_exit(agent_exit, report, graded=reward_spec.grader is not None)
        if agent_exit.grade is not None:
            # A grade is of what the agent left however it ended (its exit status, its
            # timeout): no way out of the grade is left to the agent.
            state.move_to(RolloutStatus.SCORING)
            findings.grade = agent_exit.grade
            state.succeed(agent_exit.grade.reward)
            return False
        if agent_exit.timed_out:
            state.finish_as(RolloutStatus.TIMED_OUT, timeout_message(self._spec))
            return False
        if agent_exit.exit_code != 0:
            return self._agent_failed(agent_exit, exit_message(agent_exit))
        state.move_to(RolloutStatus.SCORING)
        reward: float | None
        if reward_spec.grader is not None:
            # Not graded (graded, it was taken above): DARL's grading itself failed.
            why = agent_exit.grade_error or "the attempt was not graded"
            state.finish_as(RolloutStatus.FAILED_INFRA, f"grading failed: {why}")
            return False
        if reward_spec.function is None:
            reward = report.reward if report is not None else None
            if reward is None:
                reward = reward_spec.missing_reward
            if reward is None:
                return self._agent_failed(agent_exit, "agent finished without a reward")
        else:
            try:
                reward = await self._function_reward(attempt, agent_exit, report)
            except ActivityError as err:
                raise_if_cancelled(err)
                state.finish_as(RolloutStatus.FAILED_INFRA, f"reward failed: {cause_of(err)}")
                return False
            except RewardFailedError as err:
                state.finish_as(RolloutStatus.FAILED_INFRA, f"reward failed: {err}")
                return False
        state.succeed(reward)
        return False

    def _agent_failed(self, agent_exit: AgentExit, why: str) -> bool:
        """The agent's own failure, unless DARL's infrastructure failed it first: then the
        attempt is an infra failure and is retried (returns True)."""
        incidents = agent_exit.infra_incidents
        if incidents:
            shown = incidents_message(incidents)
            return self._state.infra_failure(f"{why}, while DARL was unavailable to it: {shown}")
        self._state.finish_as(RolloutStatus.FAILED_AGENT, why)
        return False

    async def _function_reward(
        self, attempt: int, agent_exit: AgentExit, report: AgentReport | None
    ) -> float:
        """The reward function's value: the one await_agent computed when it had the inputs
        this workflow scores with, else compute_reward's (a report came by signal, the close
        signalled the calls, or await_agent scored nothing: a revision before
        ONE_ACTIVITY_REVISION, a worker that does not score, a function that failed
        unexpectedly there). Raises RewardFailedError with the function's error."""
        findings = self._state.findings
        summary = TrajectorySummary.of_calls(
            self._spec.rollout_id,
            attempt,
            self._state.inbox.calls,
            agent_exit.exit_code,
            report,
            findings.metadata,
        )
        computed = reward_computed_at_close(agent_exit.score, summary, findings.answer)
        if computed is not None:
            return computed
        reward: float = await workflow.execute_activity(
            COMPUTE_REWARD,
            RewardRequest(spec=self._spec, answer=findings.answer, summary=summary),
            result_type=float,
            start_to_close_timeout=timedelta(seconds=self._spec.timeouts.reward_seconds),
            retry_policy=REWARD_RETRY,
        )
        return reward

    async def _report(self, result: RolloutResult) -> None:
        """Tell the trainer (if any) the result's outcome, the few hundred bytes it decides
        with, before the workflow completes: the server drops a signal-external still in
        flight when its workflow completes. A trainer that is gone does not undo the rollout.
        With `_local_report` a local activity in this last workflow task sends it through the
        worker's client, batched with other rollouts' reports to the same trainer (one signal
        and one wait for the trainer's lock per batch): no signal-external, no event, no
        workflow task after it. A retried workflow task reports the same result again, which
        the trainer counts as a duplicate."""
        report_to = self._spec.report_to
        if not report_to:
            return
        outcome = result.outcome()
        try:
            if self._local_report:
                await workflow.execute_local_activity(
                    REPORT_ROLLOUT,
                    RolloutReport(report_to=report_to, result=outcome),
                    start_to_close_timeout=REPORT_TRY_TIMEOUT,
                    retry_policy=REPORT_RETRIES,
                )
            else:
                handle = workflow.get_external_workflow_handle(report_to)
                await handle.signal(ROLLOUT_FINISHED_SIGNAL, outcome)
        except FailureError as err:
            workflow.logger.warning("could not report to %s: %s", report_to, err)

    # --- signals and queries -------------------------------------------------------------

    @workflow.signal(name=MODEL_CALLS_SIGNAL)
    def model_calls(self, events: list[ModelCallEvent]) -> None:
        """Captured calls, in batches from the gateway. Idempotent by call id; calls of an
        earlier attempt or after the agent ended are counted as stale and kept out."""
        self._state.take_calls(events)

    @workflow.signal(name=AGENT_RESULT_SIGNAL)
    def agent_result(self, report: AgentReport) -> None:
        """The agent's own report, merged into the attempt's earlier ones (RolloutInbox)."""
        self._state.inbox.take_report(report)

    @workflow.query(name=STATUS_QUERY)
    def status(self) -> RolloutProgress:
        return self._state.progress()
