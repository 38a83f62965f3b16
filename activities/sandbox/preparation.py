"""A grading's trusted steps, wherever the grading runs (the local runner's worker, a
Kubernetes grading Job's first container): the agent's workspace copied within its limits,
its change against the commit shown, what it did to the tests undone (`tampering`), the
hidden test patch applied and the canaries planted. What comes out is the tree to test and a
`Preparation`: the test files to run, the canaries, the declared expected failures and the
grade's report so far. Nothing here runs the agent's code.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypeVar

from pydantic import BaseModel

from darl.activities.sandbox import canaries
from darl.activities.sandbox.canaries import Canaries
from darl.activities.sandbox.changes import committed_tree, compare, tree_diff
from darl.activities.sandbox.errors import GradingError, SandboxError
from darl.activities.sandbox.outcomes import TestRun, declared_xfail, scored, verdict_of
from darl.activities.sandbox.tampering import apply_test_patch, patch_paths, restore_and_remove
from darl.activities.sandbox.workspace import AttemptWorkspace
from darl.activities.sandbox.workspace_copy import copy_workspace
from darl.workflows.contracts import GradeReport, SandboxLimits

T = TypeVar("T")
PATHS_SHOWN = 100
# pytest's options in every grading, before the files it runs. A failure is one line in the
# log (where and what): every honest run has failing canaries, and a short traceback of each
# costs a parse of its file (about 10 ms a grading on the shipped tasks).
PYTEST_OPTIONS = ("-q", "--tb=line", "-p", "no:cacheprovider")


class Step(Protocol):
    """How a long trusted step is awaited (while the activity heartbeats, say)."""

    def __call__(self, work: Awaitable[T], /) -> Awaitable[T]: ...


class Preparation(BaseModel):
    """What the trusted steps made ready: the files pytest runs (the listed tests' and any
    file of canaries), the canaries, the tests declared as expected to fail, and the grade's
    report so far (the diff, what was restored and removed)."""

    files: list[str]
    canaries: list[Canaries]
    xfails: list[str]
    report: GradeReport

    def graded(
        self, tests: list[str], run: TestRun, timeout_seconds: float, partial_credit: float
    ) -> GradeReport:
        """The grade of a run of the prepared tests, judged by their canaries and declared
        xfails."""
        verdict = verdict_of(run, tests, self.canaries, set(self.xfails), timeout_seconds)
        return scored(self.report, tests, verdict, partial_credit, run)


@dataclass(frozen=True)
class Task:
    """What of the task the trusted steps need: the listed tests (none for a `command`
    grader, which gets the agent's tree as it left it) and the hidden test patch."""

    tests: list[str]
    test_patch: str


async def prepare(
    workspace: AttemptWorkspace,
    tree: Path,
    task: Task,
    limits: SandboxLimits,
    step: Step | None = None,
) -> Preparation:
    """Make `tree` (new) the grading's copy of the workspace, ready to test; `step` awaits
    each long trusted step (heartbeating meanwhile; by default it is simply awaited).
    Raises UngradableWorkspaceError for what the agent left that cannot be graded,
    GradingError when DARL cannot."""
    step = step or _awaited
    copy = await step(asyncio.to_thread(copy_workspace, workspace.tree, tree, limits))
    committed = await committed_tree(workspace)
    changes = await step(asyncio.to_thread(compare, tree, committed))
    try:
        diff, cut = await step(tree_diff(workspace, tree, changes))
    except SandboxError as err:  # the diff is for people; the grade never depends on it
        diff, cut = f"# the agent's diff could not be made: {err}\n", False
    report = GradeReport(reward=0.0, diff=diff, diff_truncated=cut)
    if not task.tests:
        return Preparation(
            files=[], canaries=[], xfails=[], report=_undone(report, [], copy.left_out)
        )
    files = list(dict.fromkeys(t.split("::", 1)[0] for t in task.tests))
    must_be_committed = list(dict.fromkeys([*patch_paths(task.test_patch), *files]))
    restored, removed = await restore_and_remove(workspace, tree, changes, must_be_committed)
    await apply_test_patch(workspace, tree, task.test_patch)
    missing = [f for f in files if not await asyncio.to_thread((tree / f).is_file)]
    if missing:
        raise GradingError(f"the listed tests' files are not in the repository: {missing}")
    planted = await asyncio.to_thread(canaries.plant, tree, task.tests)
    xfails = await asyncio.to_thread(declared_xfail, tree, files)
    return Preparation(
        # A file of their own, when the canaries needed one.
        files=list(dict.fromkeys([*files, *(pair.file for pair in planted)])),
        canaries=planted,
        xfails=sorted(xfails),
        report=_undone(report, restored, [*removed, *copy.left_out]),
    )


async def _awaited(work: Awaitable[T]) -> T:
    return await work


def _undone(report: GradeReport, restored: list[str], removed: list[str]) -> GradeReport:
    return report.model_copy(
        update={"restored": _shown(restored), "removed": _shown(sorted(set(removed)))}
    )


def _shown(paths: list[str]) -> list[str]:
    """At most PATHS_SHOWN paths, as text a JSON payload can carry (a file name that is not
    UTF-8 has its odd bytes replaced)."""
    text = [p.encode("utf-8", "surrogateescape").decode("utf-8", "replace") for p in paths]
    if len(text) <= PATHS_SHOWN:
        return text
    return [*text[:PATHS_SHOWN], f"... and {len(text) - PATHS_SHOWN} more"]
