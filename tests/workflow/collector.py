"""A stand-in for the trainer in workflow tests: it collects `rollout_finished` signals and
the rollout worker's batched `rollouts_finished`, the outcomes a trainer is told."""

from __future__ import annotations

from temporalio import workflow

from darl.workflows.names import ROLLOUT_FINISHED_SIGNAL, ROLLOUTS_FINISHED_SIGNAL

with workflow.unsafe.imports_passed_through():
    from darl.workflows.contracts import RolloutOutcome


@workflow.defn
class CollectorWorkflow:
    @workflow.init
    def __init__(self, expected: int) -> None:
        self.results: list[RolloutOutcome] = []

    @workflow.run
    async def run(self, expected: int) -> list[RolloutOutcome]:
        await workflow.wait_condition(lambda: len(self.results) >= expected)
        return self.results

    @workflow.signal(name=ROLLOUT_FINISHED_SIGNAL)
    def rollout_finished(self, result: RolloutOutcome) -> None:
        self.results.append(result)

    @workflow.signal(name=ROLLOUTS_FINISHED_SIGNAL)
    def rollouts_finished(self, results: list[RolloutOutcome]) -> None:
        self.results.extend(results)
