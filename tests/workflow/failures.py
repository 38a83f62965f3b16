"""What a workflow that fails fast on bad input looks like from outside: Failed on its first
workflow task with pydantic's ValidationError (never a task failure retried every ~10 s)."""

from __future__ import annotations

import asyncio

import pytest
from temporalio.client import WorkflowFailureError, WorkflowHandle
from temporalio.exceptions import ApplicationError


async def validation_failure(handle: WorkflowHandle, timeout: float) -> ApplicationError:
    """The ValidationError the workflow failed with; fails the test otherwise."""
    with pytest.raises(WorkflowFailureError) as failure:
        await asyncio.wait_for(handle.result(), timeout)
    history = await handle.fetch_history()
    cause = failure.value.cause
    assert isinstance(cause, ApplicationError) and cause.type == "ValidationError", cause
    assert not [e for e in history.events if e.HasField("workflow_task_failed_event_attributes")]
    return cause
