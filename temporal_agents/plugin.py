"""DarlPlugin: carries a DARL attempt from the agent workflow's memo (or, in a nested child, its
start header) into the `darl-attempt` header of everything the workflow starts, and from an
activity's header into that activity's context. Interceptors only; a workflow without an
attempt (DARL did not start it) passes through untouched."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NoReturn

import temporalio.converter
import temporalio.exceptions
from temporalio import workflow
from temporalio.api.common.v1 import Payload
from temporalio.plugin import SimplePlugin
from temporalio.worker import (
    ActivityInboundInterceptor,
    ContinueAsNewInput,
    ExecuteActivityInput,
    ExecuteWorkflowInput,
    Interceptor,
    StartActivityInput,
    StartChildWorkflowInput,
    StartLocalActivityInput,
    WorkflowInboundInterceptor,
    WorkflowInterceptorClassInput,
    WorkflowOutboundInterceptor,
)

from darl.temporal_agents.attempt import AgentAttempt, enter_activity, leave_activity
from darl.workflows.names import AGENT_ATTEMPT_HEADER, AGENT_ATTEMPT_MEMO

PLUGIN_NAME = "darl.AgentAttemptPlugin"
# The header is DARL's own, read by DARL's own interceptors: the default converter (JSON),
# whatever data converter the user's client has.
_PAYLOADS = temporalio.converter.default().payload_converter


def _encode(attempt: AgentAttempt) -> Payload:
    return _PAYLOADS.to_payloads([attempt.to_value()])[0]


def _decode(payload: Payload) -> AgentAttempt:
    return AgentAttempt.from_value(_PAYLOADS.from_payloads([payload])[0])


class _AttemptOutbound(WorkflowOutboundInterceptor):
    """Adds the workflow's attempt to the headers of what it starts (once the inbound side has
    read it; none, nothing added)."""

    attempt: AgentAttempt | None = None

    def _with_attempt(self, headers: Mapping[str, Payload]) -> Mapping[str, Payload]:
        if self.attempt is None:
            return headers
        return {**headers, AGENT_ATTEMPT_HEADER: _encode(self.attempt)}

    def start_activity(self, input: StartActivityInput) -> workflow.ActivityHandle[Any]:
        input.headers = self._with_attempt(input.headers)
        return super().start_activity(input)

    def start_local_activity(self, input: StartLocalActivityInput) -> workflow.ActivityHandle[Any]:
        input.headers = self._with_attempt(input.headers)
        return super().start_local_activity(input)

    async def start_child_workflow(
        self, input: StartChildWorkflowInput
    ) -> workflow.ChildWorkflowHandle[Any, Any]:
        input.headers = self._with_attempt(input.headers)
        return await super().start_child_workflow(input)

    def continue_as_new(self, input: ContinueAsNewInput) -> NoReturn:
        # The next run reads the attempt from its start header: a memo the workflow passes
        # to continue-as-new in place of its own does not lose it.
        input.headers = self._with_attempt(input.headers)
        super().continue_as_new(input)


class _AttemptInbound(WorkflowInboundInterceptor):
    """Reads the attempt as the workflow starts: its start header (a child of an agent
    workflow), else its memo (the agent workflow DARL started)."""

    def init(self, outbound: WorkflowOutboundInterceptor) -> None:
        self._outbound = _AttemptOutbound(outbound)
        super().init(self._outbound)

    async def execute_workflow(self, input: ExecuteWorkflowInput) -> Any:
        self._outbound.attempt = _workflow_attempt(input)
        return await super().execute_workflow(input)


def _workflow_attempt(input: ExecuteWorkflowInput) -> AgentAttempt | None:
    header = input.headers.get(AGENT_ATTEMPT_HEADER)
    try:
        if header is not None:
            return _decode(header)
        if AGENT_ATTEMPT_MEMO not in workflow.memo():
            return None
        return AgentAttempt.from_value(workflow.memo_value(AGENT_ATTEMPT_MEMO))
    except ValueError as error:
        _fail_bad_attempt(error)


def _fail_bad_attempt(error: ValueError) -> NoReturn:
    # Not retryable: the memo is written once, at the start; a retry reads the same value.
    raise temporalio.exceptions.ApplicationError(
        f"bad DARL attempt in {AGENT_ATTEMPT_MEMO!r} memo or {AGENT_ATTEMPT_HEADER!r} header: "
        f"{error}",
        type="BadAgentAttempt",
        non_retryable=True,
    ) from error


class _AttemptActivityInbound(ActivityInboundInterceptor):
    """Puts the attempt of the activity's header in its context for the execution, reset
    after (an activity with no such header runs as it would without DARL)."""

    async def execute_activity(self, input: ExecuteActivityInput) -> Any:
        header = input.headers.get(AGENT_ATTEMPT_HEADER)
        if header is None:
            return await super().execute_activity(input)
        try:
            attempt = _decode(header)
        except ValueError as error:
            _fail_bad_attempt(error)
        token = enter_activity(attempt)
        try:
            return await super().execute_activity(input)
        finally:
            leave_activity(token)


class _AttemptInterceptor(Interceptor):
    def intercept_activity(self, next: ActivityInboundInterceptor) -> ActivityInboundInterceptor:
        return _AttemptActivityInbound(super().intercept_activity(next))

    def workflow_interceptor_class(
        self, input: WorkflowInterceptorClassInput
    ) -> type[WorkflowInboundInterceptor]:
        return _AttemptInbound


class DarlPlugin(SimplePlugin):
    """DARL's plugin for the worker of agents that are Temporal workflows: give it to the
    client (`Client.connect(..., plugins=[DarlPlugin()])`) or to the worker. It composes with
    the SDK's OpenAIAgentsPlugin and LangGraphPlugin; it changes no data converter, activity or
    workflow runner."""

    def __init__(self) -> None:
        super().__init__(PLUGIN_NAME, interceptors=[_AttemptInterceptor()])
