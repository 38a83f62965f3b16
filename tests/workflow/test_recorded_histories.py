"""Histories recorded by this suite's own workflow tests (tests/workflow/histories/recorded/:
every TrainingWorkflow and RolloutWorkflow that the training, branching, fault and rollout tests
ran to its end) replay under today's workflow code: moving code between modules, renaming or
splitting a loop must not change a command a running workflow already took. A workflow of the
same name that takes other commands fails the same replay, so the check can fail."""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest
from temporalio import workflow
from temporalio.client import WorkflowHistory
from temporalio.worker import Replayer

from darl.deploy.temporal_connection import DATA_CONVERTER
from darl.workflows.rollout_workflow import RolloutWorkflow
from darl.workflows.training_workflow import TrainingWorkflow

RECORDED = Path(__file__).parent / "histories" / "recorded"


def recorded(kind: str) -> list[WorkflowHistory]:
    """The stored histories of one workflow type; a file is `<type>__<id with / as _>.json.gz`."""
    histories = []
    for path in sorted(RECORDED.glob(f"{kind}__*.json.gz")):
        workflow_id = path.name.removesuffix(".json.gz").split("__", 1)[1].replace("_", "/", 1)
        histories.append(
            WorkflowHistory.from_json(workflow_id, gzip.decompress(path.read_bytes()).decode())
        )
    return histories


@pytest.mark.parametrize(
    ("workflow_class", "at_least"), [(TrainingWorkflow, 20), (RolloutWorkflow, 25)]
)
async def test_every_recorded_history_replays(workflow_class: type, at_least: int) -> None:
    histories = recorded(workflow_class.__name__)
    assert len(histories) >= at_least
    replayer = Replayer(workflows=[workflow_class], data_converter=DATA_CONVERTER)
    failures = {}
    for history in histories:
        result = await replayer.replay_workflow(history, raise_on_replay_failure=False)
        if result.replay_failure is not None:
            failures[history.workflow_id] = str(result.replay_failure)[:300]
    assert failures == {}


@workflow.defn(name="TrainingWorkflow")
class OtherTrainingWorkflow:
    """Same name, other commands: a timer where the recorded run read its tasks."""

    @workflow.run
    async def run(self, config: object) -> None:
        await workflow.sleep(1)


async def test_a_workflow_that_takes_other_commands_fails_the_replay() -> None:
    history = recorded("TrainingWorkflow")[0]
    replayer = Replayer(workflows=[OtherTrainingWorkflow], data_converter=DATA_CONVERTER)
    result = await replayer.replay_workflow(history, raise_on_replay_failure=False)
    assert result.replay_failure is not None
