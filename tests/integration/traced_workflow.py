"""A workflow for the tracing tests: two activities with a timer between (so a worker that
caches nothing replays it from the start at every task) and one continue-as-new."""

from __future__ import annotations

from datetime import timedelta

from temporalio import workflow

STEP = "traced_step"


@workflow.defn(name="TracedWorkflow")
class TracedWorkflow:
    @workflow.run
    async def run(self, continued: bool) -> str:
        await workflow.execute_activity(STEP, "first", start_to_close_timeout=timedelta(seconds=30))
        await workflow.sleep(timedelta(milliseconds=100))
        await workflow.execute_activity(
            STEP, "second", start_to_close_timeout=timedelta(seconds=30)
        )
        if not continued:
            workflow.continue_as_new(True)
        return "done"
