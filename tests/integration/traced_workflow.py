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


@workflow.defn(name="HandingOnWorkflow")
class HandingOnWorkflow:
    """For the test of a workflow that hands its starter's trace header on: started with a
    signal (whose handler runs before the workflow's code), then an activity and a local
    activity."""

    def __init__(self) -> None:
        self._signalled = False

    @workflow.run
    async def run(self) -> str:
        await workflow.wait_condition(lambda: self._signalled)
        await workflow.execute_activity(
            STEP, "activity", start_to_close_timeout=timedelta(seconds=30)
        )
        await workflow.execute_local_activity(
            STEP, "local", start_to_close_timeout=timedelta(seconds=30)
        )
        return "done"

    @workflow.signal(name="go")
    def go(self) -> None:
        self._signalled = True
