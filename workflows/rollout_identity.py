"""A rollout id's one workflow id and one result (rules 2 and 7): the check that a
RolloutWorkflow runs under its rollout's workflow id, and the error that hands it the result of
an earlier execution of that id (rollout_outcomes.earlier_run). Deterministic: workflow code."""

from __future__ import annotations

from temporalio import workflow
from temporalio.exceptions import ApplicationError

from darl.workflows.contracts import RolloutResult, rollout_workflow_id
from darl.workflows.errors import WorkflowsError
from darl.workflows.names import WRONG_WORKFLOW_ID_ERROR


def check_workflow_id(rollout_id: str) -> None:
    """The gateway, the workers and the trainer find a rollout by its one workflow id: under
    any other id its agent's calls would be refused, so the workflow fails at once."""
    expected = rollout_workflow_id(rollout_id)
    actual = workflow.info().workflow_id
    if actual != expected:
        raise ApplicationError(
            f"rollout {rollout_id!r} must run under the workflow id "
            f"{expected!r}, not {actual!r} (start it with --workflow-id {expected})",
            type=WRONG_WORKFLOW_ID_ERROR,
            non_retryable=True,
        )


class EarlierRunError(WorkflowsError):
    """This rollout id already has a result, from an earlier execution: it is the result."""

    def __init__(self, result: RolloutResult) -> None:
        super().__init__(result.rollout_id)
        self.result = result
