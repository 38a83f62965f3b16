"""RolloutWorkflow: one agent rollout, durable from launch to reward.

Reads as the story of a rollout: launch the agent, await it under the rollout timeout, score it,
tell the trainer. An infra failure (launch failed, agent lost with its worker's machine) gets a
fresh attempt, which resumes by replay of the calls the lost one recorded (rule 10); what the
agent itself did (non-zero exit, timeout, no reward) is the result.

What the server does per rollout bounds rollouts per second, so an attempt of an HTTP agent is
one activity: await_agent enforces the timeout and returns the calls the gateway's close handed
over and the reward it computed; and the report to the trainer is a local activity in the last
workflow task, which the worker batches with other rollouts'. Which command sequence a rollout
runs is its `RolloutSpec.revision`: the table above CURRENT_REVISION in contracts.py.
"""

from __future__ import annotations

import asyncio
import hashlib
from datetime import datetime, timedelta
from typing import Any

from temporalio import workflow
from temporalio.common import RetryPolicy, SearchAttributeUpdate
from temporalio.exceptions import ActivityError, ApplicationError, CancelledError, FailureError

with workflow.unsafe.imports_passed_through():
    from pydantic import ValidationError

    from darl.workflows import search_attributes as sa
    from darl.workflows.contracts import (
        LOCAL_REPORT_REVISION,
        ONE_ACTIVITY_REVISION,
        AgentExit,
        AgentHandle,
        AgentReport,
        AwaitRequest,
        GradeReport,
        HttpAgentSpec,
        LaunchRequest,
        ModelCallEvent,
        ReplayOutcome,
        RewardRequest,
        RolloutProgress,
        RolloutReport,
        RolloutResult,
        RolloutSpec,
        TrajectorySummary,
        rollout_workflow_id,
    )
    from darl.workflows.names import (
        AGENT_LOST_ERROR,
        AGENT_RESULT_SIGNAL,
        AGENT_SPEC_ERROR,
        AWAIT_AGENT,
        COMPUTE_REWARD,
        LAUNCH_AGENT,
        MODEL_CALLS_SIGNAL,
        REPORT_ROLLOUT,
        REWARD_SPEC_ERROR,
        ROLLOUT_ALREADY_RAN_ERROR,
        ROLLOUT_FINISHED_SIGNAL,
        ROLLOUT_WORKFLOW,
        STATUS_QUERY,
        STOP_AGENT,
        WRONG_WORKFLOW_ID_ERROR,
    )
    from darl.workflows.rollout_outcomes import (
        EarlierRunError,
        RewardFailedError,
        cause_of,
        earlier_run,
        error_type,
        merged,
        raise_if_cancelled,
    )
    from darl.workflows.rollout_status import (
        TRANSITIONS,
        IllegalTransitionError,
        RolloutStatus,
        check_transition,
    )

# Statuses a rollout passes through in a moment; not published as search attributes.
BRIEF_STATUSES = frozenset({RolloutStatus.LAUNCHING, RolloutStatus.SCORING})

# With one activity (`_one_activity`): await_agent's margin past the rollout timeout to close
# the attempt and score it. Without: the workflow keeps a timer, and await_agent enforces its
# own deadline this long after it, in case the workflow cannot cancel it (its workers down).
RUNNER_DEADLINE_GRACE = timedelta(seconds=60)
# A rollout starts another attempt only while its history is at most this (rule 12): an
# attempt at its bounds (the spec in each activity's input, 32 reports, 2,048 call events,
# its close) adds well under 10 MiB, and Temporal ends a history past 50 MB.
HISTORY_FOR_ANOTHER_ATTEMPT = 32 * 2**20
# How much of each incident an infra failure's error quotes.
INCIDENT_CHARS = 500
# How many failed model calls a RolloutResult says in words (it counts them all).
FAILED_CALLS_SHOWN = 5
# The report's local activity: each try is a signal's round trip (batched), retried while the
# trainer's Temporal is unreachable; past the last try the trainer looks the rollout up
# (`reconcile_after_seconds`).
REPORT_TRY_TIMEOUT = timedelta(seconds=30)
REPORT_RETRIES = RetryPolicy(
    initial_interval=timedelta(seconds=1),
    maximum_interval=timedelta(seconds=10),
    maximum_attempts=10,
)
# A launch is tried a few times; past them, the attempt is an infra failure and the next
# attempt launches afresh. An agent spec that cannot start anything is not retried.
LAUNCH_RETRY = RetryPolicy(
    initial_interval=timedelta(seconds=1),
    maximum_attempts=3,
    non_retryable_error_types=[AGENT_SPEC_ERROR],
)
# A retry after a lost heartbeat re-attaches to the running agent (rule 3); an agent gone
# without an exit status is the attempt's infra failure at once.
AWAIT_RETRY = RetryPolicy(
    initial_interval=timedelta(seconds=1),
    maximum_interval=timedelta(seconds=10),
    maximum_attempts=20,
    non_retryable_error_types=[AGENT_LOST_ERROR],
)
# Stopping an agent whose launch was cancelled: a few tries, then a warning.
STOP_RETRY = RetryPolicy(maximum_attempts=3)
# compute_reward: a few tries; past them, the rollout failed for infra reasons.
REWARD_RETRY = RetryPolicy(maximum_attempts=3)


def _fail_on_bad_reward(err: ActivityError) -> None:
    """A reward that cannot work is bad input (rule 9): the workflow fails at once with the
    reason, before any agent ran, as a run's start check fails a training run."""
    if error_type(err) == REWARD_SPEC_ERROR:
        raise ApplicationError(cause_of(err), type=REWARD_SPEC_ERROR, non_retryable=True)


# A ValidationError is input no retry can fix (a RolloutSpec the temporal CLI sent that does
# not validate): the workflow fails at once with pydantic's message (rule 9).
@workflow.defn(
    name=ROLLOUT_WORKFLOW, failure_exception_types=[IllegalTransitionError, ValidationError]
)
class RolloutWorkflow:
    @workflow.init
    def __init__(self, spec: RolloutSpec) -> None:
        self._spec = spec
        # Once: the task can be large, and the details are rewritten at every change.
        self._summary = sa.rollout_summary(spec)
        self._status = RolloutStatus.PENDING
        self._attempt = 0
        self._accepting_signals = False
        self._calls: list[ModelCallEvent] = []
        self._seen_call_ids: set[str] = set()
        # Calls that reproduce the prefix's (a branch's), directly or through an earlier
        # attempt: what an attempt whose close never came counts as its prefix.
        self._prefix_replays: set[str] = set()
        self._reports: dict[int, AgentReport] = {}
        self._duplicate_signals = 0
        self._stale_signals = 0
        self._reward: float | None = None
        self._answer: str | None = None
        self._exit_code: int | None = None
        self._error: str | None = None
        self._metadata: dict[str, Any] = {}
        # The final attempt's model calls that got no answer (status, protocol, error; the
        # first few) and how many there were.
        self._failed_calls: list[str] = []
        self._failed_call_count = 0
        # The latest call received (highest attempt, then sequence): its version is the
        # rollout's last serving version, DarlPolicyVersion.
        self._last_call: ModelCallEvent | None = None
        self._published_version = spec.policy_version
        # The command sequence the spec's revision asks for (the table above CURRENT_REVISION
        # in contracts.py).
        self._one_activity = spec.revision >= ONE_ACTIVITY_REVISION
        self._local_report = spec.revision >= LOCAL_REPORT_REVISION
        # The attempts whose recorded calls the next attempt replays, newest first (rule 10),
        # and what the current attempt made of the record it was handed.
        self._replay_lineage: list[int] = []
        self._replay: ReplayOutcome | None = None
        # The grader's verdict on the final attempt (RewardSpec.grader), and what its agent
        # claimed meanwhile.
        self._grade: GradeReport | None = None
        self._agent_claim: AgentReport | None = None

    # --- the story ---------------------------------------------------------------------

    @workflow.run
    async def run(self, spec: RolloutSpec) -> RolloutResult:
        self._check_workflow_id()
        started = workflow.now()
        initial = sa.rollout_attributes(spec, self._status.value)
        # A starter that set them (the trainer does) saves the server an upsert per rollout.
        given = workflow.info().typed_search_attributes
        if any(given.get(pair.key) != pair.value for pair in initial):
            workflow.upsert_search_attributes([p.key.value_set(p.value) for p in initial])
        self._show_details()
        try:
            for attempt in range(1, spec.max_attempts + 1):
                retry = await self._run_attempt(attempt)
                if not retry or attempt == spec.max_attempts or self._history_spent():
                    break
                self._hand_on_record(attempt)
                await workflow.sleep(timedelta(seconds=spec.timeouts.retry_backoff_seconds))
        except EarlierRunError as earlier:
            return self._result_of_earlier_run(earlier.result)
        except asyncio.CancelledError:
            if self._status == RolloutStatus.LAUNCHING:
                await self._stop_launched_agent()
            if RolloutStatus.CANCELLED in TRANSITIONS[self._status]:
                self._error = "rollout was cancelled"
                self._transition(RolloutStatus.CANCELLED)
                await self._report(self._result(started))
            raise
        result = self._result(started)
        await self._report(result)
        return result

    def _history_spent(self) -> bool:
        """Whether the history has no room for another attempt (rule 12): each can add a few
        MB (its inputs carry the spec; reports, call events, its close), and Temporal ends a
        workflow whose history passes 50 MB, losing its report. The rollout ends with the
        failure it has, saying so, instead."""
        size = workflow.info().get_current_history_size()
        if size <= HISTORY_FOR_ANOTHER_ATTEMPT:
            return False
        self._error = (
            f"{self._error}; no attempt after {self._attempt}: the rollout's history holds "
            f"{size / 2**20:.1f} MiB of the 50 MB Temporal allows"
        )
        return True

    async def _run_attempt(self, attempt: int) -> bool:
        """Run one attempt to its end. Returns True when it failed for infra reasons."""
        self._start_attempt(attempt)
        try:
            handle = await self._launch(attempt)
        except ActivityError as err:
            raise_if_cancelled(err)
            if error_type(err) == ROLLOUT_ALREADY_RAN_ERROR:
                raise earlier_run(err) from err
            _fail_on_bad_reward(err)
            if error_type(err) == AGENT_SPEC_ERROR:
                self._finish_as(RolloutStatus.FAILED_AGENT, f"agent cannot start: {cause_of(err)}")
                return False
            return self._infra_failure(f"launching the agent failed: {cause_of(err)}")
        self._transition(RolloutStatus.RUNNING)
        try:
            agent_exit = await self._await_agent(handle)
            if agent_exit is not None:
                # Delivered by the close instead of a signal: taken like one.
                self._receive_calls(agent_exit.calls, count_duplicates=False)
                self._replay = agent_exit.replay
        except ActivityError as err:
            raise_if_cancelled(err)
            if error_type(err) == ROLLOUT_ALREADY_RAN_ERROR:
                raise earlier_run(err) from err
            _fail_on_bad_reward(err)
            return self._infra_failure(f"lost the agent: {cause_of(err)}")
        finally:
            self._accepting_signals = False
        if agent_exit is None:
            self._finish_as(RolloutStatus.TIMED_OUT, self._timeout_message())
            return False
        return await self._score(attempt, agent_exit)

    def _hand_on_record(self, attempt: int) -> None:
        """An attempt lost to an infrastructure failure hands the calls it recorded to the
        next one, which replays them (rule 10). Its record holds the calls it replayed
        itself, so a third attempt replays the second; and if it was lost before its replay
        was over, the calls it had yet to replay continue it (the gateway reads that in the
        records: the lineage names where to look). An attempt of which the workflow knows no
        call (lost before its first, or before any reached the workflow) hands on the record
        it was handed."""
        if self._spec.resume == "replay" and self._calls:
            self._replay_lineage = [attempt, *self._replay_lineage]

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
            LaunchRequest(spec=self._spec, attempt=attempt, replay_from=self._replay_lineage),
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
                LaunchRequest(spec=self._spec, attempt=self._attempt),
                start_to_close_timeout=timedelta(seconds=self._spec.timeouts.launch_seconds),
                retry_policy=STOP_RETRY,
            )
        except ActivityError as err:
            workflow.logger.warning("could not stop the agent being launched: %s", cause_of(err))

    async def _await_agent(self, handle: AgentHandle) -> AgentExit | None:
        """The agent's exit (timed out if the runner ended it at the rollout timeout), or None
        when the workflow's own timer fired first (agent killed; without `_one_activity`)."""
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
                replay_from=self._replay_lineage,
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
        self._exit_code = agent_exit.exit_code
        self._failed_calls = list(agent_exit.failed_calls)
        count = agent_exit.failed_call_count
        self._failed_call_count = len(self._failed_calls) if count is None else count
        report = merged(self._reports.get(attempt), agent_exit.report)
        reward_spec = self._spec.reward
        if reward_spec.grader is not None:
            # DARL decides the reward: what the agent says of itself is its claim, kept apart.
            self._agent_claim = report
        elif report is not None:
            self._answer = report.answer
            self._metadata = dict(report.metadata)
        if agent_exit.grade is not None:
            # A grade is of what the agent left however it ended (its exit status, its
            # timeout): no way out of the grade is left to the agent.
            self._transition(RolloutStatus.SCORING)
            self._grade = agent_exit.grade
            self._reward = agent_exit.grade.reward
            self._transition(RolloutStatus.SUCCEEDED, [sa.REWARD.value_set(self._reward)])
            return False
        if agent_exit.timed_out:
            self._finish_as(RolloutStatus.TIMED_OUT, self._timeout_message())
            return False
        if agent_exit.exit_code != 0:
            return self._agent_failed(agent_exit, self._exit_message(agent_exit))
        self._transition(RolloutStatus.SCORING)
        reward: float | None
        if reward_spec.grader is not None:
            # Not graded (graded, it was taken above): DARL's grading itself failed.
            why = agent_exit.grade_error or "the attempt was not graded"
            self._finish_as(RolloutStatus.FAILED_INFRA, f"grading failed: {why}")
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
                self._finish_as(RolloutStatus.FAILED_INFRA, f"reward failed: {cause_of(err)}")
                return False
            except RewardFailedError as err:
                self._finish_as(RolloutStatus.FAILED_INFRA, f"reward failed: {err}")
                return False
        self._reward = reward
        self._transition(RolloutStatus.SUCCEEDED, [sa.REWARD.value_set(reward)])
        return False

    def _agent_failed(self, agent_exit: AgentExit, why: str) -> bool:
        """The agent's own failure, unless DARL's infrastructure failed it first: then the
        attempt is an infra failure and is retried (returns True)."""
        incidents = agent_exit.infra_incidents
        if incidents:
            shown = "; ".join(i[:INCIDENT_CHARS] for i in incidents[:3])
            shown += "; ..." if len(incidents) > 3 else ""
            return self._infra_failure(f"{why}, while DARL was unavailable to it: {shown}")
        self._finish_as(RolloutStatus.FAILED_AGENT, why)
        return False

    async def _function_reward(
        self, attempt: int, agent_exit: AgentExit, report: AgentReport | None
    ) -> float:
        """The reward function's value: the one await_agent computed when it had exactly the
        inputs this workflow scores with (the same calls, answer, report and metadata), else
        compute_reward's (a report came by signal, the close signalled the calls, an older
        worker). Raises RewardFailedError with the function's error."""
        summary = TrajectorySummary.of_calls(
            self._spec.rollout_id,
            attempt,
            self._calls,
            agent_exit.exit_code,
            report,
            self._metadata,
        )
        score = agent_exit.score
        if score is not None and score.summary == summary and score.answer == self._answer:
            if score.reward is None:
                raise RewardFailedError(score.error or "the reward function gave no reward")
            return score.reward
        reward: float = await workflow.execute_activity(
            COMPUTE_REWARD,
            RewardRequest(spec=self._spec, answer=self._answer, summary=summary),
            result_type=float,
            start_to_close_timeout=timedelta(seconds=self._spec.timeouts.reward_seconds),
            retry_policy=REWARD_RETRY,
        )
        return reward

    async def _report(self, result: RolloutResult) -> None:
        """Tell the trainer (if any). A trainer that is gone does not undo the rollout.

        Before the workflow completes: the server drops a signal-external still in flight
        when its workflow completes. With `_local_report` a local activity sends it through
        the worker's client, batched with the other rollouts' reports to the same trainer (one
        signal, and one wait for the trainer's lock, per batch rather than per rollout), in
        this last workflow task: no signal-external, no signalled event, no workflow task
        after it. A workflow task that is retried reports the same result again, which the
        trainer counts as a duplicate. Otherwise it awaits a signal-external. Either way the
        trainer is told the result's outcome, the few hundred bytes it decides with."""
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
        self._receive_calls(events)

    def _receive_calls(self, events: list[ModelCallEvent], count_duplicates: bool = True) -> None:
        """Take calls in, by signal or from await_agent's result (which holds every call of
        the attempt, some perhaps signalled already: not duplicate signals)."""
        for event in events:
            if event.call_id in self._seen_call_ids:
                if count_duplicates:
                    self._duplicate_signals += 1
                continue
            self._seen_call_ids.add(event.call_id)
            if event.attempt != self._attempt or not self._accepting_signals:
                self._stale_signals += 1
                continue
            self._calls.append(event)
            if self._reproduces_the_prefix(event):
                self._prefix_replays.add(event.call_id)
            last = self._last_call
            if last is None or (event.attempt, event.sequence) > (last.attempt, last.sequence):
                self._last_call = event
        self._show_details()

    @workflow.signal(name=AGENT_RESULT_SIGNAL)
    def agent_result(self, report: AgentReport) -> None:
        """The agent's own report. A later report of the attempt overrides the fields it sets
        (the last reward wins) and keeps those it leaves out. One over a report's budget
        (sent around the gateway, which refuses it) is counted with the stale ones, unused."""
        if (
            report.attempt != self._attempt
            or not self._accepting_signals
            or report.over_budget() is not None
        ):
            self._stale_signals += 1
            return
        self._reports[report.attempt] = merged(self._reports.get(report.attempt), report)

    @workflow.query(name=STATUS_QUERY)
    def status(self) -> RolloutProgress:
        return RolloutProgress(
            rollout_id=self._spec.rollout_id,
            status=self._status,
            attempt=self._attempt,
            calls=len(self._calls),
            prompt_tokens=sum(c.prompt_tokens for c in self._calls),
            completion_tokens=sum(c.completion_tokens for c in self._calls),
            reward=self._reward,
            error=self._error,
            replayed_calls=self._replayed_calls(),
        )

    # --- state ---------------------------------------------------------------------------

    def _check_workflow_id(self) -> None:
        """The gateway, the workers and the trainer find a rollout by its one workflow id
        (rule 2): under any other id its agent's calls would be refused, so fail at once."""
        expected = rollout_workflow_id(self._spec.rollout_id)
        actual = workflow.info().workflow_id
        if actual != expected:
            raise ApplicationError(
                f"rollout {self._spec.rollout_id!r} must run under the workflow id "
                f"{expected!r}, not {actual!r} (start it with --workflow-id {expected})",
                type=WRONG_WORKFLOW_ID_ERROR,
                non_retryable=True,
            )

    def _result_of_earlier_run(self, earlier: RolloutResult) -> RolloutResult:
        """This execution started after the rollout had already run to a result: that result
        is the rollout's one result. No agent ran, nothing is reported again."""
        workflow.logger.warning(
            "rollout %s already ran to %s; returning that result",
            earlier.rollout_id,
            earlier.status,
        )
        also = [] if earlier.reward is None else [sa.REWARD.value_set(earlier.reward)]
        workflow.upsert_search_attributes([sa.STATUS.value_set(earlier.status.value), *also])
        self._show_details(earlier)
        return earlier

    def _start_attempt(self, attempt: int) -> None:
        self._attempt = attempt
        self._calls = []
        self._reports.pop(attempt - 1, None)
        self._accepting_signals = True
        self._error = None
        self._replay = None
        self._grade = None
        self._agent_claim = None
        self._transition(RolloutStatus.LAUNCHING)

    def _transition(
        self, status: RolloutStatus, also: list[SearchAttributeUpdate[Any]] | None = None
    ) -> None:
        self._status = check_transition(self._status, status)
        self._show_details()
        # Brief statuses are left to the `status` query: each upsert is a history event and
        # a visibility write, and the server's work is what bounds rollouts per second. So is
        # RUNNING on a first attempt with one activity (a retry's replaces failed_infra).
        if status in BRIEF_STATUSES or (
            self._one_activity and status == RolloutStatus.RUNNING and self._attempt == 1
        ):
            return
        updates: list[SearchAttributeUpdate[Any]] = [
            sa.STATUS.value_set(status.value),
            *(also or []),
        ]
        # The last serving version rides on the status upserts the rollout makes anyway (an
        # attempt's end, the final status) rather than costing an upsert per call. Replay
        # compares an upsert's command type, not its attributes, so histories recorded
        # before this attribute was added still replay.
        version = self._serving_version()
        if version != self._published_version:
            updates.append(sa.POLICY_VERSION.value_set(version))
            self._published_version = version
        workflow.upsert_search_attributes(updates)

    def _serving_version(self) -> int:
        last = self._last_call
        return last.policy_version if last is not None else self._spec.policy_version

    def _show_details(self, earlier: RolloutResult | None = None) -> None:
        """What the Web UI's workflow page shows as current details: this execution's, or the
        `earlier` run's result it returns. Workflow memory only (the
        `__temporal_workflow_metadata` query reads it), so keeping it current costs nothing."""
        workflow.set_current_details(
            sa.rollout_details(
                self._summary,
                max_attempts=self._spec.max_attempts,
                status=(earlier.status if earlier else self._status).value,
                attempt=earlier.attempts if earlier else self._attempt,
                calls=earlier.calls if earlier else len(self._calls),
                replayed=earlier.replayed_calls if earlier else self._replayed_calls(),
                policy_version=self._serving_version(),
                reward=earlier.reward if earlier else self._reward,
                error=earlier.error if earlier else self._error,
            )
        )

    def _replayed_calls(self) -> int:
        return sum(1 for c in self._calls if c.replayed_from is not None)

    def _infra_failure(self, error: str) -> bool:
        self._error = error
        self._transition(RolloutStatus.FAILED_INFRA)
        workflow.logger.warning("rollout attempt %d: %s", self._attempt, error)
        return True

    def _finish_as(self, status: RolloutStatus, error: str) -> None:
        self._error = error
        self._transition(status)

    def _timeout_message(self) -> str:
        return f"agent did not finish within {self._spec.timeouts.agent_seconds:g}s"

    @staticmethod
    def _exit_message(agent_exit: AgentExit) -> str:
        why = "was OOM-killed" if agent_exit.oom_killed else f"exited with {agent_exit.exit_code}"
        tail = agent_exit.log_tail.strip()
        return f"agent {why}" + (f"; log tail:\n{tail}" if tail else "")

    def _result(self, started: datetime) -> RolloutResult:
        call_ids = [c.call_id for c in sorted(self._calls, key=lambda c: c.sequence)]
        return RolloutResult(
            run_id=self._spec.run_id,
            rollout_id=self._spec.rollout_id,
            group_id=self._spec.group_id,
            mode=self._spec.mode,
            status=self._status,
            reward=self._reward,
            answer=self._answer,
            attempts=self._attempt,
            calls=len(self._calls),
            prompt_tokens=sum(c.prompt_tokens for c in self._calls),
            completion_tokens=sum(c.completion_tokens for c in self._calls),
            policy_versions=sorted({c.policy_version for c in self._calls}),
            call_ids=call_ids,
            events_digest=hashlib.sha256("\n".join(call_ids).encode()).hexdigest(),
            exit_code=self._exit_code,
            error=self._error,
            duration_seconds=(workflow.now() - started).total_seconds(),
            duplicate_signals=self._duplicate_signals,
            stale_signals=self._stale_signals,
            metadata=self._metadata,
            failed_calls=self._failed_call_count,
            failed_call_errors=self._failed_calls[:FAILED_CALLS_SHOWN],
            replayed_calls=self._replayed_calls(),
            replay_diverged_at=self._replay.diverged_at if self._replay is not None else None,
            prefix_calls=self._prefix_calls(),
            prefix_diverged_at=self._prefix_diverged_at(),
            grade=self._grade,
            agent_claim=self._agent_claim,
        )

    def _reproduces_the_prefix(self, event: ModelCallEvent) -> bool:
        """Whether a call replays the prefix's (a branch's): one replayed from a call of
        another rollout, or from a call of an earlier attempt of this one that did (a call
        replayed from an earlier attempt's own is a resumption)."""
        source = event.replayed_from
        if self._spec.prefix is None or source is None:
            return False
        return source not in self._seen_call_ids or source in self._prefix_replays

    def _prefix_calls(self) -> int:
        """The final attempt's calls that reproduced the prefix, as its close said; for an
        attempt whose close never came (cancelled at the run's end), its calls replayed from
        the prefix, so that they are never counted as a resumption."""
        if self._replay is not None:
            return self._replay.prefix_calls
        return sum(1 for c in self._calls if c.call_id in self._prefix_replays)

    def _prefix_diverged_at(self) -> int | None:
        """Where a rollout that starts from a prefix left it before its end, as the close of
        the final attempt said; None when it reproduced it whole, or nobody could say."""
        prefix, replay = self._spec.prefix, self._replay
        if prefix is None or replay is None or replay.prefix_calls >= prefix.calls:
            return None
        return replay.prefix_calls
