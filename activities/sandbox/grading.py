"""DARL's grader (GraderSpec): a reward computed by running a command in the attempt's sandbox
after its agent, so the agent can neither report nor fake it.

Each grading works in a fresh copy of the agent's final workspace (`workspace_copy`: bounded,
no link followed, nothing that could block read), so a retried await_agent grades the same
agent state again, to the same result. The trusted steps run here, outside the sandbox: the
copy, the agent's diff, and for `swe_tests` the undoing of its tampering (`tampering`), the
hidden test patch and two canary tests (`canaries`). Only the run of the tests, which
executes the agent's code, happens in the sandbox, with no network at all, under the
sandbox's limits and the rollout's reward timeout. `swe_tests` runs FAIL_TO_PASS and
PASS_TO_PASS with pytest as `python -I -B` (no start-up hooks, no byte code), plugins
autoloading off, no cache, DARL's plugin writing each outcome to a pipe opened here
(`pytest_results`), and a run counts only as an honest one ends (`outcomes`).

Cause decides the outcome: what the agent left that makes grading impossible (a workspace over
its limits, a path too long) grades 0 with the reason; only DARL's own machinery failing (its
git, the sandbox, its Python) is a GradingError.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from darl.activities.agent_contract import env_map_values
from darl.activities.heartbeats import Heartbeater
from darl.activities.processes import PipeReader, file_tail
from darl.activities.runners.base import agent_heartbeat_interval
from darl.activities.sandbox import pytest_results
from darl.activities.sandbox.agent import check_sandbox
from darl.activities.sandbox.bubblewrap import (
    RUN_DIR,
    SandboxLayout,
    SandboxRun,
    SandboxTools,
    bwrap_argv,
    give_to,
    kept_environment,
    run_sandboxed,
    sandbox_uid,
    write_etc,
)
from darl.activities.sandbox.errors import (
    GradingError,
    SandboxError,
    SandboxSpecError,
    UngradableWorkspaceError,
)
from darl.activities.sandbox.outcomes import (
    LOG_TAIL_BYTES,
    RESULTS_CAP_BYTES,
    Records,
    TestRun,
    canary_note,
    commanded,
    ungradable,
)
from darl.activities.sandbox.preparation import PYTEST_OPTIONS, Preparation, Task, prepare
from darl.activities.sandbox.workspace import AttemptWorkspace, open_workspace
from darl.activities.sandbox.workspace_copy import remove_tree
from darl.activities.worker_paths import expand, expand_sandbox
from darl.workflows.contracts import (
    GradeReport,
    GraderSpec,
    LocalAgentSpec,
    RolloutSpec,
    SandboxSpec,
)
from darl.workflows.heartbeats import Heartbeat

GRADING_PREFIX = "grading-"

SANDBOX_PLUGIN = f"{RUN_DIR}/pytest_results.py"
# How long the results pipe may stay open once the run has ended (only a process that left
# the run's process group, without isolation, can hold it).
RESULTS_DRAIN_SECONDS = 5.0
PLUGIN_FILE = str(Path(pytest_results.__file__).resolve())


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
    raises SandboxSpecError (or TaskFieldError for an `env_map` value the task lacks or
    holds too large). A Kubernetes agent's grading Job is the runner's to check."""
    grader = spec.reward.grader
    if grader is None:
        return
    if isinstance(spec.agent, LocalAgentSpec):
        check_sandbox(_grader_and_sandbox(spec)[1])
    if grader.kind == "swe_tests":
        listed_tests(spec.task)
        hidden_test_patch(spec.task)
    env_map_values(spec.task, grader.env_map)


async def grade(spec: RolloutSpec, attempt_dir: Path, heartbeat: Heartbeat) -> GradeReport:
    """Grade the attempt whose directory is `attempt_dir` (its agent has ended). Raises
    SandboxSpecError for a grader that cannot work on this task, GradingError when grading
    could not run; what the agent left that cannot be graded grades 0."""
    grader, sandbox = _grader_and_sandbox(spec)
    tests = listed_tests(spec.task) if grader.kind == "swe_tests" else []
    tools = check_sandbox(sandbox)
    try:
        workspace = open_workspace(attempt_dir)
    except SandboxError as err:
        raise GradingError(str(err)) from None
    began = time.monotonic()
    run_dir = Path(tempfile.mkdtemp(prefix=GRADING_PREFIX, dir=attempt_dir))
    try:
        grading = _Grading(spec, grader, sandbox, workspace, run_dir, tools, heartbeat)
        try:
            report = await grading.run(tests)
        except UngradableWorkspaceError as err:
            report = ungradable(tests, str(err))
    except (SandboxSpecError, GradingError):
        raise
    except (SandboxError, OSError) as err:
        raise GradingError(f"grading {attempt_dir} failed: {err}") from err
    finally:
        await asyncio.to_thread(remove_tree, run_dir)
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
        tools: SandboxTools | None,
        heartbeat: Heartbeat,
    ) -> None:
        self._spec, self._grader, self._sandbox = spec, grader, sandbox
        self._workspace, self._tools = workspace, tools
        self._heartbeater = Heartbeater(
            heartbeat, agent_heartbeat_interval(spec.timeouts.heartbeat_seconds)
        )
        self._run_dir = run_dir
        self._tree = run_dir / "testbed"
        self._log = run_dir / "grading.log"
        # The grading's own host user (a root worker's sandbox runs as one).
        self._uid = sandbox_uid(str(run_dir)) if tools is not None else None

    async def run(self, tests: list[str]) -> GradeReport:
        task = Task(tests, hidden_test_patch(self._spec.task) if tests else "")
        prepared = await prepare(
            self._workspace, self._tree, task, self._sandbox.limits, self._heartbeater
        )
        await asyncio.to_thread(give_to, self._tree, self._uid)
        if self._grader.kind == "command":
            run = await self._run([expand(p) for p in self._grader.command or []])
            return commanded(
                prepared.report,
                run.exit_code,
                run.timed_out,
                self._spec.timeouts.reward_seconds,
                file_tail(self._log, LOG_TAIL_BYTES),
            )
        return await self._tested(prepared, tests)

    async def _tested(self, prepared: Preparation, tests: list[str]) -> GradeReport:
        read_end, write_end = os.pipe()
        reading = PipeReader(read_end, RESULTS_CAP_BYTES)
        try:
            # The run closes our copy of the write end, once its command has one.
            command = self._pytest(prepared.files, write_end)
            run = await self._run(command, hand_over=(write_end,))
        except BaseException:
            reading.close()
            raise
        results, results_cut = await reading.read(RESULTS_DRAIN_SECONDS)
        with self._log.open("a") as log:
            log.write(canary_note(prepared.canaries))
        test_run = TestRun(
            records=Records.read(results.decode("utf-8", errors="replace")),
            exit_code=run.exit_code,
            timed_out=run.timed_out,
            cut=results_cut,
            log_tail=file_tail(self._log, LOG_TAIL_BYTES),
        )
        if not test_run.records.started and not run.timed_out:
            # Before the repository's code could run: the grader's Python, not the agent.
            raise GradingError(
                f"pytest did not start in the grading sandbox ({sys.executable} needs it): "
                f"{test_run.log_tail[-500:]}"
            )
        return prepared.graded(
            tests, test_run, self._spec.timeouts.reward_seconds, self._grader.partial_credit
        )

    def _pytest(self, files: list[str], results_fd: int) -> list[str]:
        inside = self._tools is not None
        root = self._sandbox.workdir if inside else str(self._tree)
        plugin = SANDBOX_PLUGIN if inside else PLUGIN_FILE
        return [
            sys.executable,
            "-I",
            "-B",
            plugin,
            "--results-fd",
            str(results_fd),
            "--root",
            root,
            "--",
            *PYTEST_OPTIONS,
            "--rootdir",
            root,
            *files,
        ]

    async def _run(self, command: list[str], hand_over: tuple[int, ...] = ()) -> SandboxRun:
        """Run `command` in the grading's sandbox; the descriptors `hand_over` are closed here
        whatever happens (once the command has them, if it starts)."""
        try:
            env = kept_environment(os.environ)
            env |= env_map_values(self._spec.task, self._grader.env_map)
            env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
            argv, cwd = command, self._tree
            if self._tools is not None:
                layout = SandboxLayout(
                    workspace=self._tree,
                    workdir=self._sandbox.workdir,
                    limits=self._sandbox.limits,
                    uid=self._uid,
                    read_only=(sys.base_prefix, sys.prefix, *self._sandbox.read_only),
                    files=((PLUGIN_FILE, SANDBOX_PLUGIN), *write_etc(self._run_dir / "etc")),
                )
                argv = bwrap_argv(self._tools, layout, command)
                env["PWD"] = self._sandbox.workdir
        except BaseException:
            for fd in hand_over:
                os.close(fd)
            raise
        run = await run_sandboxed(
            argv,
            env=env,
            log_path=self._log,
            timeout=self._spec.timeouts.reward_seconds,
            heartbeater=self._heartbeater,
            cwd=cwd,
            bwrap=self._tools is not None,
            hand_over=hand_over,
        )
        if run.exit_code is not None and run.exit_code < 0:  # killed by a signal, unsandboxed
            run = SandboxRun(128 - run.exit_code, run.timed_out, run.started, run.seconds)
        return run
