"""DARL's grader (GraderSpec): a reward computed by running a command in the attempt's sandbox
after its agent, so the agent can neither report nor fake it.

Each grading works in a fresh copy of the agent's final workspace (a retried await_agent
grades the same agent state again, to the same result). The trusted steps run here, outside
the sandbox: the copy, the agent's diff, and for `swe_tests` the undoing of its tampering
(`tampering`) and the hidden test patch. Only the run of the tests, which executes the agent's
code, happens in the sandbox, with no network at all, under the rollout's reward timeout.
`swe_tests` runs FAIL_TO_PASS and PASS_TO_PASS with pytest as `python -I -B` (no start-up
hooks, no byte code), plugins autoloading off, no cache, and reads each test's outcome from
DARL's plugin (`pytest_results`): a test it did not record as passed has failed.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

from darl.activities.agent_contract import env_map_values
from darl.activities.processes import file_tail
from darl.activities.runners.base import agent_heartbeat_interval
from darl.activities.sandbox import pytest_results
from darl.activities.sandbox.agent import check_sandbox
from darl.activities.sandbox.bubblewrap import (
    RUN_DIR,
    SandboxLayout,
    SandboxRun,
    bwrap_argv,
    kept_environment,
    run_sandboxed,
)
from darl.activities.sandbox.changes import committed_tree, compare, copy_tree, tree_diff
from darl.activities.sandbox.errors import GradingError, SandboxError, SandboxSpecError
from darl.activities.sandbox.tampering import apply_test_patch, patch_paths, restore_and_remove
from darl.activities.sandbox.workspace import AttemptWorkspace, open_workspace
from darl.activities.worker_paths import expand, expand_sandbox
from darl.workflows.contracts import (
    GradeReport,
    GraderSpec,
    LocalAgentSpec,
    RolloutSpec,
    SandboxSpec,
)
from darl.workflows.heartbeats import Heartbeat

T = TypeVar("T")

GRADING_PREFIX = "grading-"
LOG_TAIL_BYTES = 8 * 1024
FAILED_SHOWN = 20
PATHS_SHOWN = 100
SANDBOX_PLUGIN = f"{RUN_DIR}/pytest_results.py"
SANDBOX_RESULTS = f"{RUN_DIR}/results"
RESULTS_FILE = "results.jsonl"
# At most this much of the results is read (the code under test could fill the file).
RESULTS_CAP_BYTES = 16 * 1024 * 1024
PLUGIN_FILE = str(Path(pytest_results.__file__).resolve())
PYTEST_OPTIONS = ("-q", "--tb=short", "-p", "no:cacheprovider")


def _grader_and_sandbox(spec: RolloutSpec) -> tuple[GraderSpec, SandboxSpec]:
    grader, agent = spec.reward.grader, spec.agent
    if grader is None or not isinstance(agent, LocalAgentSpec) or agent.sandbox is None:
        raise SandboxSpecError("grading needs a reward 'grader' and a local agent's 'sandbox'")
    return grader, expand_sandbox(agent.sandbox)


def listed_tests(task: Any) -> list[str]:
    """FAIL_TO_PASS then PASS_TO_PASS, each a list or a JSON list (as SWE-bench writes them)."""
    if not isinstance(task, dict):
        raise SandboxSpecError("a 'swe_tests' grader needs an object task")
    tests: list[str] = []
    for name in ("FAIL_TO_PASS", "PASS_TO_PASS"):
        value = task.get(name, [])
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as err:
                raise SandboxSpecError(f"the task's {name} is not a JSON list: {err}") from None
        if not isinstance(value, list) or not all(isinstance(t, str) and t for t in value):
            raise SandboxSpecError(f"the task's {name} must be a list of test ids")
        tests += value
    unsafe = [t for t in tests if t.startswith(("-", "/")) or ".." in t.split("::")[0].split("/")]
    if unsafe:
        raise SandboxSpecError(f"test ids must be paths inside the repository: {unsafe[:3]}")
    if not tests:
        raise SandboxSpecError("the task's FAIL_TO_PASS and PASS_TO_PASS list no tests")
    return list(dict.fromkeys(tests))


def hidden_test_patch(task: Any) -> str:
    """The task's `test_patch` (SWE-bench's hidden tests), empty when it has none."""
    patch = task.get("test_patch", "") if isinstance(task, dict) else ""
    if not isinstance(patch, str):
        raise SandboxSpecError("the task's test_patch must be a string (a unified diff)")
    return patch


def check_grader(spec: RolloutSpec) -> None:
    """Refuse, before any agent runs, a grader that cannot work on this task here (rule 9):
    raises SandboxSpecError (or TaskPathError for an `env_map` path the task lacks)."""
    grader, sandbox = _grader_and_sandbox(spec)
    check_sandbox(sandbox)
    if grader.kind == "swe_tests":
        listed_tests(spec.task)
        hidden_test_patch(spec.task)
    env_map_values(spec.task, grader.env_map)


def passed_tests(records: str) -> tuple[set[str], bool]:
    """The node ids the plugin recorded as passed (or xfailed) with no phase failed, and
    whether pytest was there to run them (imported before any of the repository's code)."""
    passed, failed, started = set(), set(), False
    for line in records.splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not isinstance(record, dict):
            continue
        if record.get("event") == "pytest":
            started = True
        nodeid, outcome = record.get("nodeid"), record.get("outcome")
        if not isinstance(nodeid, str):
            continue
        if outcome == "failed":
            failed.add(nodeid)
        elif record.get("when") == "call" and (
            outcome == "passed" or (outcome == "skipped" and record.get("xfail") is True)
        ):
            passed.add(nodeid)
    return passed - failed, started


async def grade(spec: RolloutSpec, attempt_dir: Path, heartbeat: Heartbeat) -> GradeReport:
    """Grade the attempt whose directory is `attempt_dir` (its agent has ended). Raises
    SandboxSpecError for a grader that cannot work on this task, GradingError when grading
    could not run."""
    grader, sandbox = _grader_and_sandbox(spec)
    tests = listed_tests(spec.task) if grader.kind == "swe_tests" else []
    bwrap = check_sandbox(sandbox)
    try:
        workspace = open_workspace(attempt_dir)
    except SandboxError as err:
        raise GradingError(str(err)) from None
    began = time.monotonic()
    run_dir = Path(tempfile.mkdtemp(prefix=GRADING_PREFIX, dir=attempt_dir))
    try:
        grading = _Grading(spec, grader, sandbox, workspace, run_dir, bwrap, heartbeat)
        report = await grading.run(tests)
    except (SandboxSpecError, GradingError):
        raise
    except (SandboxError, OSError) as err:
        raise GradingError(f"grading {attempt_dir} failed: {err}") from err
    finally:
        await asyncio.to_thread(_remove_tree, run_dir)
    return report.model_copy(update={"seconds": round(time.monotonic() - began, 3)})


class _Grading:
    """One grading of an attempt, in its own directory (`run_dir`)."""

    def __init__(
        self,
        spec: RolloutSpec,
        grader: GraderSpec,
        sandbox: SandboxSpec,
        workspace: AttemptWorkspace,
        run_dir: Path,
        bwrap: str | None,
        heartbeat: Heartbeat,
    ) -> None:
        self._spec, self._grader, self._sandbox = spec, grader, sandbox
        self._workspace, self._bwrap, self._heartbeat = workspace, bwrap, heartbeat
        self._every = agent_heartbeat_interval(spec.timeouts.heartbeat_seconds)
        self._tree = run_dir / "testbed"
        self._results = run_dir / "results"
        self._log = run_dir / "grading.log"

    async def run(self, tests: list[str]) -> GradeReport:
        left_out = await self._beating(
            asyncio.to_thread(copy_tree, self._workspace.tree, self._tree)
        )
        committed = await committed_tree(self._workspace)
        changes = await self._beating(asyncio.to_thread(compare, self._tree, committed))
        try:
            diff, cut = await self._beating(tree_diff(self._workspace, self._tree, changes))
        except SandboxError as err:  # the diff is for people; the grade never depends on it
            diff, cut = f"# the agent's diff could not be made: {err}\n", False
        restored: list[str] = []
        removed: list[str] = []
        if self._grader.kind == "swe_tests":
            patch = hidden_test_patch(self._spec.task)
            files = list(dict.fromkeys(t.split("::", 1)[0] for t in tests))
            restored, removed = await restore_and_remove(
                self._workspace, self._tree, changes, [*patch_paths(patch), *files]
            )
            await apply_test_patch(self._workspace, self._tree, patch)
            missing = [f for f in files if not await asyncio.to_thread((self._tree / f).exists)]
            if missing:
                raise GradingError(f"the listed tests' files are not in the repository: {missing}")
            command = self._pytest(files)
        else:
            command = [expand(p) for p in self._grader.command or []]
        run = await self._run(command)
        log_tail = file_tail(self._log, LOG_TAIL_BYTES)
        if not run.started:
            raise GradingError(f"the grading sandbox did not start: {log_tail[-500:]}")
        report = GradeReport(
            reward=0.0,
            exit_code=run.exit_code,
            timed_out=run.timed_out,
            restored=_shown(restored),
            removed=_shown(sorted({*removed, *left_out})),
            diff=diff,
            diff_truncated=cut,
            log_tail=log_tail,
        )
        if self._grader.kind == "command":
            ok = run.exit_code == 0 and not run.timed_out
            return report.model_copy(update={"reward": 1.0 if ok else 0.0})
        return self._scored(report, tests)

    def _scored(self, report: GradeReport, tests: list[str]) -> GradeReport:
        passed, started = passed_tests(_head(self._results / RESULTS_FILE, RESULTS_CAP_BYTES))
        if not started and not report.timed_out:
            # Before the repository's code could run: the grader's Python, not the agent.
            raise GradingError(
                f"pytest did not start in the grading sandbox ({sys.executable} needs it): "
                f"{report.log_tail[-500:]}"
            )
        ok = [t for t in tests if t in passed]
        if report.timed_out:
            reward = 0.0
        elif len(ok) == len(tests):
            reward = 1.0
        else:
            reward = self._grader.partial_credit * len(ok) / len(tests)
        failed = [t for t in tests if t not in passed]
        return report.model_copy(
            update={
                "reward": reward,
                "tests": len(tests),
                "passed": len(ok),
                "failed_tests": failed[:FAILED_SHOWN],
            }
        )

    def _pytest(self, files: list[str]) -> list[str]:
        inside = self._bwrap is not None
        root = self._sandbox.workdir if inside else str(self._tree)
        plugin = SANDBOX_PLUGIN if inside else PLUGIN_FILE
        results = f"{SANDBOX_RESULTS if inside else self._results}/{RESULTS_FILE}"
        return [
            sys.executable,
            "-I",
            "-B",
            plugin,
            "--results",
            results,
            "--root",
            root,
            "--",
            *PYTEST_OPTIONS,
            "--rootdir",
            root,
            *files,
        ]

    async def _run(self, command: list[str]) -> SandboxRun:
        self._results.mkdir()
        env = kept_environment(os.environ) | env_map_values(self._spec.task, self._grader.env_map)
        env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
        argv, cwd = command, self._tree
        if self._bwrap is not None:
            layout = SandboxLayout(
                workspace=self._tree,
                workdir=self._sandbox.workdir,
                read_only=(sys.base_prefix, sys.prefix, *self._sandbox.read_only),
                files=((PLUGIN_FILE, SANDBOX_PLUGIN),),
                writable=((str(self._results), SANDBOX_RESULTS),),
            )
            argv, env["PWD"] = bwrap_argv(self._bwrap, layout, command), self._sandbox.workdir
        return await run_sandboxed(
            argv,
            env=env,
            log_path=self._log,
            timeout=self._spec.timeouts.reward_seconds,
            heartbeat=self._heartbeat,
            heartbeat_every=self._every,
            cwd=cwd,
            bwrap=self._bwrap is not None,
        )

    async def _beating(self, work: Awaitable[T]) -> T:
        """Await a trusted step (a copy, a walk) while heartbeating."""
        task = asyncio.ensure_future(work)
        while True:
            done, _ = await asyncio.wait({task}, timeout=self._every)
            if done:
                return task.result()
            self._heartbeat()


def _shown(paths: list[str]) -> list[str]:
    """At most PATHS_SHOWN paths, as text a JSON payload can carry (a file name that is not
    UTF-8 has its odd bytes replaced)."""
    text = [p.encode("utf-8", "surrogateescape").decode("utf-8", "replace") for p in paths]
    if len(text) <= PATHS_SHOWN:
        return text
    return [*text[:PATHS_SHOWN], f"... and {len(text) - PATHS_SHOWN} more"]


def _head(path: Path, cap: int) -> str:
    try:
        with path.open("rb") as f:
            return f.read(cap).decode("utf-8", errors="replace")
    except FileNotFoundError:
        return ""


def _remove_tree(path: Path) -> None:
    """Remove a grading directory, even one whose tests took their own write permission."""

    def writable_and_again(func: Callable[[str], object], failed: str, _exc: object) -> None:
        os.chmod(os.path.dirname(failed), 0o700)
        func(failed)

    shutil.rmtree(path, onerror=writable_and_again)
