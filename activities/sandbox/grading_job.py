"""The first container of a Kubernetes grading Job (`runners/kubernetes_grading`), in DARL's
own image: the grading's trusted steps on the attempt's volume, before the task's image runs
the tests.

The volume holds `workspace/` (what the agent left) and `base/` (the image's repository as it
was before the agent, which no container of the agent's mounted). `base/` is made a commit
of a git directory of DARL's on the volume, and the steps run as the local grader's do
(`preparation`): the copy within the limits, the diff, the undoing of tampering, the hidden
test patch (from the Secret the agent's Job never saw) and the canaries, into `grading/`,
which the tests container mounts at the workdir. DARL's plugin and pytest's arguments go to
the run folder, which that container mounts read-only.

It prints one line for the runner, which reads its log through the API: `DARL-PREPARED
<json>` (exit 0), `DARL-UNGRADABLE <reason>` (exit 3: the agent's outcome), or `DARL-FAILED
<why>` (exit 4: DARL could not grade).

    python -m darl.activities.sandbox.grading_job --attempt DIR --task FILE --run DIR \
        --workdir /testbed
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import json
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel, Field

from darl.activities.sandbox import pytest_results
from darl.activities.sandbox.errors import SandboxError, UngradableWorkspaceError
from darl.activities.sandbox.preparation import PYTEST_OPTIONS, Preparation, Task, prepare
from darl.activities.sandbox.workspace import GIT_DIR, AttemptWorkspace, git
from darl.activities.sandbox.workspace_copy import remove_tree
from darl.workflows.contracts import SandboxLimits

T = TypeVar("T")

BASE_SUBPATH = "base"
GRADING_SUBPATH = "grading"
PREPARED_MARK, UNGRADABLE_MARK, FAILED_MARK = "DARL-PREPARED", "DARL-UNGRADABLE", "DARL-FAILED"
UNGRADABLE_EXIT, FAILED_EXIT = 3, 4


class GradingTask(BaseModel):
    """What the runner hands the trusted steps (in a Secret): the listed tests (none for a
    `command` grader) and the hidden test patch, the workspace's limits."""

    tests: list[str] = Field(default_factory=list)
    test_patch: str = ""
    limits: SandboxLimits = Field(default_factory=SandboxLimits)


async def base_commit(attempt: Path) -> str:
    """Commit `<attempt>/base` (every file, ignore rules aside) to a git directory of DARL's
    at `<attempt>/git`, made afresh; its id."""
    git_dir = attempt / GIT_DIR
    await asyncio.to_thread(remove_tree, git_dir)
    await git("init", "--quiet", "--bare", "--template=", str(git_dir))
    base, index = attempt / BASE_SUBPATH, git_dir / "index"
    await git("add", "--all", "--force", git_dir=git_dir, work_tree=base, index=index)
    await git(
        *("-c", "user.name=darl", "-c", "user.email=darl@localhost"),
        *("commit", "--quiet", "--no-verify", "--allow-empty", "-m", "the image's repository"),
        git_dir=git_dir,
        work_tree=base,
        index=index,
    )
    return (await git("rev-parse", "HEAD", git_dir=git_dir)).decode().strip()


async def prepared(attempt: Path, task: GradingTask, run: Path, workdir: str) -> Preparation:
    """The trusted steps: `<attempt>/grading/testbed` made ready to test, DARL's plugin and
    pytest's arguments in `run`."""
    commit = await base_commit(attempt)
    workspace = AttemptWorkspace(attempt, commit)
    grading = attempt / GRADING_SUBPATH
    await asyncio.to_thread(remove_tree, grading)
    grading.mkdir()
    preparation = await prepare(
        workspace, grading / "testbed", Task(task.tests, task.test_patch), task.limits
    )
    shutil.copyfile(pytest_results.__file__, run / "pytest_results.py")
    arguments = [*PYTEST_OPTIONS, "--rootdir", workdir, *preparation.files]
    (run / "args.json").write_text(json.dumps(arguments))
    return preparation


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--attempt", type=Path, required=True)
    parser.add_argument("--task", type=Path, required=True)
    parser.add_argument("--run", type=Path, required=True)
    parser.add_argument("--workdir", required=True)
    args = parser.parse_args(argv)
    try:
        task = GradingTask.model_validate_json(args.task.read_text())
        preparation = asyncio.run(prepared(args.attempt, task, args.run, args.workdir))
    except UngradableWorkspaceError as err:
        _say(UNGRADABLE_MARK, _one_line(str(err)))
        return UNGRADABLE_EXIT
    except OSError as err:
        # The workspace was within its limits (measured before a byte was copied): a full
        # volume is the worker's size for it, too small for this image's repository.
        full = " (the attempt's volume is full: a larger --k8s-grading-volume-size)"
        _say(FAILED_MARK, _one_line(f"{err}{full if err.errno == errno.ENOSPC else ''}"))
        return FAILED_EXIT
    except (SandboxError, ValueError) as err:
        _say(FAILED_MARK, _one_line(f"{type(err).__name__}: {err}"))
        return FAILED_EXIT
    _say(PREPARED_MARK, preparation.model_dump_json())
    return 0


def _say(mark: str, text: str) -> None:
    """One line for the runner, on the container's output (its log, read through the API)."""
    sys.stdout.write(f"{mark} {text}\n")
    sys.stdout.flush()


def _one_line(text: str) -> str:
    return " ".join(text.split())


if __name__ == "__main__":
    sys.exit(main())
