"""What the viewer reads from Temporal, read-only: training runs and rollouts through
visibility (search attributes, one page at a time), a workflow's start input, a closed
workflow's result and a running one's queries. It never signals, updates, cancels or starts."""

from __future__ import annotations

import asyncio
import base64
import binascii
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any

from temporalio.api.enums.v1 import EventType
from temporalio.client import (
    Client,
    WorkflowExecution,
    WorkflowExecutionStatus,
    WorkflowFailureError,
    WorkflowQueryFailedError,
)
from temporalio.service import RPCError, RPCStatusCode

from darl.viewer.errors import ViewerError
from darl.workflows import search_attributes as sa
from darl.workflows.contracts import (
    RolloutProgress,
    RolloutResult,
    RolloutSpec,
    rollout_workflow_id,
)
from darl.workflows.names import (
    METRICS_QUERY,
    ROLLOUT_WORKFLOW,
    STATUS_QUERY,
    TRAINING_WORKFLOW,
)
from darl.workflows.training_config import TrainingConfig, training_workflow_id
from darl.workflows.training_messages import TrainingProgress, TrainingSummary
from darl.workflows.training_state import StepRecord

log = logging.getLogger(__name__)

# A query goes to a worker; one that is restarting must not hang a page.
QUERY_TIMEOUT = timedelta(seconds=3)
PAGE_SIZES = (20, 50, 100, 200)


class NotFoundError(ViewerError, LookupError):
    """What a page or command was asked for that nothing knows of (rendered as a 404)."""

    def __init__(self, what: str) -> None:
        super().__init__(what)
        self.what = what


@dataclass(frozen=True)
class WorkflowRow:
    """One workflow as visibility lists it."""

    workflow_id: str
    status: str
    started: datetime | None
    closed: datetime | None
    run: str | None
    group: str | None
    phase: str | None
    mode: str | None
    reward: float | None
    policy_version: int | None
    step: int | None

    @property
    def name(self) -> str:
        """The run or rollout id (the workflow id less its `train/` or `rollout/`)."""
        return self.workflow_id.partition("/")[2] or self.workflow_id


def _row(execution: WorkflowExecution) -> WorkflowRow:
    attributes = execution.typed_search_attributes
    return WorkflowRow(
        workflow_id=execution.id,
        status=execution.status.name.lower() if execution.status else "unknown",
        started=execution.start_time,
        closed=execution.close_time,
        run=attributes.get(sa.RUN),
        group=attributes.get(sa.GROUP),
        phase=attributes.get(sa.STATUS),
        mode=attributes.get(sa.MODE),
        reward=attributes.get(sa.REWARD),
        policy_version=attributes.get(sa.POLICY_VERSION),
        step=attributes.get(sa.STEP),
    )


@dataclass(frozen=True)
class RolloutFilters:
    """The rollouts table's filters; each one is a visibility clause over a search attribute."""

    policy_version: int | None = None
    status: str | None = None
    mode: str | None = None
    group: str | None = None
    reward_min: float | None = None
    reward_max: float | None = None

    def query(self, run_id: str) -> str:
        clauses = [f"WorkflowType = '{ROLLOUT_WORKFLOW}'", f"{sa.RUN.name} = {_quoted(run_id)}"]
        if self.policy_version is not None:
            clauses.append(f"{sa.POLICY_VERSION.name} = {int(self.policy_version)}")
        for key, value in ((sa.STATUS, self.status), (sa.MODE, self.mode), (sa.GROUP, self.group)):
            if value:
                clauses.append(f"{key.name} = {_quoted(value)}")
        if self.reward_min is not None:
            clauses.append(f"{sa.REWARD.name} >= {float(self.reward_min)!r}")
        if self.reward_max is not None:
            clauses.append(f"{sa.REWARD.name} <= {float(self.reward_max)!r}")
        return " AND ".join(clauses)


def _quoted(value: str) -> str:
    """A visibility string literal: quotes and backslashes escaped, so a filter typed into
    the page cannot change the query's shape."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def encode_page_token(token: bytes | None) -> str | None:
    return base64.urlsafe_b64encode(token).decode() if token else None


def decode_page_token(text: str | None) -> bytes | None:
    if not text:
        return None
    try:
        return base64.b64decode(text.encode(), altchars=b"-_", validate=True)
    except (binascii.Error, ValueError):
        raise NotFoundError(f"page token {text[:40]!r} (not one this viewer made)") from None


@dataclass(frozen=True)
class RolloutPage:
    rows: Sequence[WorkflowRow]
    next_token: str | None
    query: str


@dataclass(frozen=True)
class RunView:
    """A training run as its workflow shows it: the live queries when a worker answers them,
    else what the run left (its summary)."""

    run_id: str
    status: str
    progress: TrainingProgress | None
    records: list[StepRecord]
    summary: TrainingSummary | None
    failure: str | None
    config: TrainingConfig | None
    query_error: str | None = None


@dataclass(frozen=True)
class RolloutState:
    """A rollout as Temporal knows it: the spec it started with, and its result (closed) or
    its progress (running)."""

    rollout_id: str
    workflow_status: str
    spec: RolloutSpec | None
    result: RolloutResult | None = None
    progress: RolloutProgress | None = None
    failure: str | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def last_attempt(self) -> int | None:
        if self.result is not None:
            return self.result.attempts or None
        if self.progress is not None:
            return self.progress.attempt or None
        return None


class TemporalNotReachedError(ViewerError):
    """The viewer has not reached Temporal yet; it keeps trying (its pages answer 503)."""


class TemporalView:
    """Read-only access to DARL's workflows in one namespace, over one client, which may
    come later than the view (`reached`): a viewer starts before Temporal answers."""

    def __init__(
        self, client: Client | None, namespace: str = "default", address: str = ""
    ) -> None:
        self._client = client
        self._namespace = client.namespace if client is not None else namespace
        self.address = address

    def reached(self, client: Client) -> None:
        self._client = client

    @property
    def client(self) -> Client:
        if self._client is None:
            raise TemporalNotReachedError(
                f"the viewer has not reached Temporal at {self.address or '?'} yet; it keeps "
                "trying (is `darl dev` running?)"
            )
        return self._client

    @property
    def namespace(self) -> str:
        return self._namespace

    async def runs(self, limit: int = 200) -> list[WorkflowRow]:
        """The newest training runs (one row per workflow id: its newest execution)."""
        query = f"WorkflowType = '{TRAINING_WORKFLOW}'"
        seen: dict[str, WorkflowRow] = {}
        async for execution in self.client.list_workflows(query, limit=limit, page_size=limit):
            seen.setdefault(execution.id, _row(execution))
        return list(seen.values())

    async def rollouts(
        self, run_id: str, filters: RolloutFilters, page_token: str | None, page_size: int
    ) -> RolloutPage:
        """One page of the run's rollouts, newest first; never more than one visibility call."""
        query = filters.query(run_id)
        pages = self.client.list_workflows(
            query, page_size=page_size, next_page_token=decode_page_token(page_token)
        )
        try:
            await pages.fetch_next_page()
        except RPCError as err:
            # The dev server answers UNKNOWN to a token it cannot parse, a cluster
            # INVALID_ARGUMENT: either way the page asked for does not exist.
            unreadable = (RPCStatusCode.INVALID_ARGUMENT, RPCStatusCode.UNKNOWN)
            if page_token and err.status in unreadable:
                raise NotFoundError(f"page token {page_token[:40]!r} ({err.message})") from None
            raise
        rows = [_row(e) for e in pages.current_page or []]
        return RolloutPage(rows, encode_page_token(pages.next_page_token), query)

    async def group(self, group_id: str, limit: int = 1024) -> list[WorkflowRow]:
        query = f"WorkflowType = '{ROLLOUT_WORKFLOW}' AND {sa.GROUP.name} = {_quoted(group_id)}"
        rows = [
            _row(e) async for e in self.client.list_workflows(query, limit=limit, page_size=limit)
        ]
        return sorted(rows, key=lambda r: r.workflow_id)

    async def start_input(self, workflow_id: str, kind: type[Any]) -> Any:
        """The input the workflow's current run started with (a continue-as-new carries the
        config on); None when the workflow does not exist or its input is not a `kind` of
        this DARL (a spec that failed validation at once, another version's config)."""
        handle = self.client.get_workflow_handle(workflow_id)
        try:
            async for event in handle.fetch_history_events(page_size=1):
                if event.event_type != EventType.EVENT_TYPE_WORKFLOW_EXECUTION_STARTED:
                    return None
                payloads = event.workflow_execution_started_event_attributes.input.payloads
                [value] = await self.client.data_converter.decode(payloads, [kind])
                return value
        except RPCError as err:
            if err.status == RPCStatusCode.NOT_FOUND:
                return None
            raise
        except ValueError as err:  # pydantic's ValidationError among them
            log.warning("%s: its input is not a %s: %s", workflow_id, kind.__name__, err)
            return None
        return None

    async def training_config(self, run_id: str) -> TrainingConfig | None:
        config = await self.start_input(training_workflow_id(run_id), TrainingConfig)
        return config if isinstance(config, TrainingConfig) else None

    async def _status(self, workflow_id: str) -> WorkflowExecutionStatus | None:
        try:
            described = await self.client.get_workflow_handle(workflow_id).describe()
        except RPCError as err:
            if err.status == RPCStatusCode.NOT_FOUND:
                return None
            raise
        return described.status

    async def run(self, run_id: str) -> RunView:
        """Raises NotFoundError for a run id with no TrainingWorkflow."""
        workflow_id = training_workflow_id(run_id)
        status = await self._status(workflow_id)
        if status is None:
            raise NotFoundError(f"training run {run_id!r} (no workflow {workflow_id})")
        handle = self.client.get_workflow_handle(workflow_id, result_type=TrainingSummary)
        config = await self.training_config(run_id)
        summary = failure = query_error = None
        progress, records = None, []
        if status == WorkflowExecutionStatus.COMPLETED:
            try:
                summary = await handle.result()
            except ValueError as err:
                failure = f"completed, but its summary does not read as this DARL's: {err}"
        elif status != WorkflowExecutionStatus.RUNNING:
            failure = await self._failure(handle, status)
        try:
            progress = await handle.query(
                STATUS_QUERY, result_type=TrainingProgress, rpc_timeout=QUERY_TIMEOUT
            )
            records = await handle.query(
                METRICS_QUERY, result_type=list[StepRecord], rpc_timeout=QUERY_TIMEOUT
            )
        except (RPCError, WorkflowQueryFailedError) as err:
            # No trainer worker answers (a closed run's worker is gone, one is restarting):
            # the caller falls back to the run's metrics.jsonl.
            query_error = getattr(err, "message", None) or str(err)
        return RunView(
            run_id, status.name.lower(), progress, records, summary, failure, config, query_error
        )

    async def answers(self, rows: Sequence[WorkflowRow], at_once: int = 16) -> dict[str, str]:
        """The answers of the completed rollouts among `rows` (their results), by rollout id;
        one that cannot be read is left out."""
        limit = asyncio.Semaphore(at_once)

        async def answer(row: WorkflowRow) -> tuple[str, str | None]:
            handle = self.client.get_workflow_handle(row.workflow_id, result_type=RolloutResult)
            async with limit:
                try:
                    result = await handle.result(follow_runs=False)
                except (RPCError, WorkflowFailureError, ValueError):
                    return row.name, None
            return row.name, result.answer

        done = [r for r in rows if r.status == "completed"]
        found = await asyncio.gather(*(answer(r) for r in done))
        return {name: text for name, text in found if text is not None}

    async def rollout(self, rollout_id: str) -> RolloutState | None:
        """None when Temporal has no workflow for the rollout."""
        workflow_id = rollout_workflow_id(rollout_id)
        status = await self._status(workflow_id)
        if status is None:
            return None
        handle = self.client.get_workflow_handle(workflow_id, result_type=RolloutResult)
        spec = await self.start_input(workflow_id, RolloutSpec)
        state = RolloutState(
            rollout_id, status.name.lower(), spec if isinstance(spec, RolloutSpec) else None
        )
        if status == WorkflowExecutionStatus.COMPLETED:
            try:
                result = await handle.result()
            except ValueError as err:
                note = f"completed, but its result does not read as this DARL's: {err}"
                return replace(state, notes=[note])
            return replace(state, result=result)
        if status != WorkflowExecutionStatus.RUNNING:
            failure = await self._failure(handle, status)
            return replace(state, failure=failure)
        try:
            progress = await handle.query(
                STATUS_QUERY, result_type=RolloutProgress, rpc_timeout=QUERY_TIMEOUT
            )
        except (RPCError, WorkflowQueryFailedError) as err:
            note = f"the status query got no answer ({getattr(err, 'message', err)})"
            return replace(state, notes=[note])
        return replace(state, progress=progress)

    @staticmethod
    async def _failure(handle: Any, status: WorkflowExecutionStatus) -> str:
        name = status.name.lower()
        try:
            await handle.result(follow_runs=False)
        except WorkflowFailureError as err:
            cause = err.cause
            return f"{name}: {getattr(cause, 'message', None) or cause}"
        return name
