"""An agent that is a Temporal workflow (`WorkflowAgentSpec`): the RolloutWorkflow runs each
attempt's agent as its child, on the user's worker, and reads how it ended as it reads a
process's exit. Workflow code: deterministic."""

from __future__ import annotations

import asyncio
import json
import math
from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.common import RawValue
from temporalio.exceptions import (
    CancelledError,
    ChildWorkflowError,
    TerminatedError,
    TimeoutError,
)

from darl.workflows.contracts import AgentExit, AgentHandle, AgentReport, RolloutSpec
from darl.workflows.contracts.agent_specs import WorkflowAgentSpec
from darl.workflows.json_paths import value_at
from darl.workflows.names import AGENT_ATTEMPT_MEMO

# How much of an agent workflow's failure the attempt's log tail keeps.
FAILURE_CHARS = 2000


def agent_workflow_id(rollout_id: str, attempt: int) -> str:
    """The one workflow id of an attempt's agent workflow: a start that is retried (its
    workflow task lost with DARL's worker) never makes a second agent."""
    return f"rollout/{rollout_id}/agent/{attempt}"


async def run_agent_workflow(spec: RolloutSpec, handle: AgentHandle) -> AgentExit:
    """Run the attempt's agent workflow as the rollout's child and say how it ended. The
    memo carries the attempt as a process agent's environment would (the gateway's base URL
    and the attempt's token, from `handle.data`); the rollout timeout is its execution
    timeout, kept by the server whatever the agent's worker does. Cancelling the rollout
    requests the child's cancellation without waiting on it, and the rollout closing ends a
    child still running (its parent close policy), so no agent outlives its rollout."""
    agent = spec.agent
    if not isinstance(agent, WorkflowAgentSpec):
        raise TypeError(f"not a workflow agent: {agent.kind}")
    attempt = {
        "base_url": handle.data["base_url"],
        "token": handle.data["token"],
        "rollout_id": spec.rollout_id,
        "attempt": handle.attempt,
    }
    try:
        result = await workflow.execute_child_workflow(
            agent.workflow,
            spec.workflow_agent_input(),
            id=agent_workflow_id(spec.rollout_id, handle.attempt),
            task_queue=agent.task_queue,
            memo={AGENT_ATTEMPT_MEMO: attempt},
            execution_timeout=timedelta(seconds=spec.timeouts.agent_seconds),
            cancellation_type=workflow.ChildWorkflowCancellationType.TRY_CANCEL,
            parent_close_policy=workflow.ParentClosePolicy.TERMINATE,
            # Read here, not by the SDK: a result no converter can read (an integer of
            # thousands of digits, say) is the agent's failure, not a workflow task that
            # fails again and again.
            result_type=RawValue,
        )
    except ChildWorkflowError as err:
        task = asyncio.current_task()
        if isinstance(err.cause, CancelledError) and task is not None and task.cancelling():
            # The rollout itself is being cancelled: its cancellation, not the agent's end.
            raise asyncio.CancelledError from err
        return _failed(err)
    try:
        value = workflow.payload_converter().from_payload(result.payload)
    except Exception as err:  # noqa: BLE001 - whatever the agent returned, it ends its attempt
        return AgentExit(exit_code=1, log_tail=f"the agent workflow's result is unreadable: {err}")
    return exit_of_result(agent, handle.attempt, value)


def _failed(err: ChildWorkflowError) -> AgentExit:
    """An agent workflow that did not complete: past the rollout timeout it timed out; failed,
    cancelled or terminated by anyone but this rollout, it is the agent's failure."""
    cause = err.cause
    if isinstance(cause, TimeoutError):
        return AgentExit(exit_code=None, timed_out=True)
    if isinstance(cause, CancelledError):
        why = "the agent workflow was cancelled"
    elif isinstance(cause, TerminatedError):
        why = "the agent workflow was terminated"
    else:
        why = f"the agent workflow failed: {cause if cause is not None else err}"
    return AgentExit(exit_code=1, log_tail=why[-FAILURE_CHARS:])


def exit_of_result(agent: WorkflowAgentSpec, attempt: int, result: Any) -> AgentExit:
    """A completed agent workflow's report: the answer at `answer_field` (a string as it is,
    any other value as JSON) and the reward at `reward_field`. A result that lacks what the
    spec names, or a reward that is not a finite number, is the agent's failure."""
    try:
        answer = _answer(value_at(result, agent.answer_field or ""))
        reward = None
        if agent.reward_field is not None:
            reward = _reward(value_at(result, agent.reward_field), agent.reward_field)
    except LookupError as missing:
        return AgentExit(
            exit_code=1, log_tail=f"the agent workflow's result has no field {missing.args[0]!r}"
        )
    except ValueError as err:
        return AgentExit(exit_code=1, log_tail=str(err))
    report = AgentReport(attempt=attempt, reward=reward, answer=answer)
    if (over := report.over_budget()) is not None:
        return AgentExit(exit_code=1, log_tail=over)
    return AgentExit(exit_code=0, report=report)


def _answer(value: Any) -> str | None:
    if value is None or isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False, sort_keys=True)


def _reward(value: Any, field: str) -> float:
    """The reported reward as a float; ValueError for anything but a finite number (an
    integer too large for a float included: it would otherwise fail the workflow task)."""
    wrong = ValueError(f"the agent workflow's reward {field!r} is not a finite number")
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise wrong
    try:
        reward = float(value)
    except OverflowError:
        raise wrong from None
    if not math.isfinite(reward):
        raise wrong
    return reward
