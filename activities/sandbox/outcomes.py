"""What a grading's test run established: the listed tests that passed, or why none counts.

The records come from DARL's plugin inside the test process (`pytest_results`), which the
code under test shares, so a record alone proves nothing: a run counts only when it ended
as an honest run ends (pytest's own end of session, exit status 1 because the canary that
must fail failed), its canaries came out right (`canaries`), and no hook or test run was
replaced. A test passes when its call passed and no phase failed; an expected failure
(xfail) counts as a pass only when DARL's own copy of the test file declares it.
"""

from __future__ import annotations

import ast
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from darl.activities.sandbox.canaries import PARAMETRIZED, Canaries
from darl.activities.sandbox.pytest_results import ALTERED, FINISH, FOREIGN, START
from darl.workflows.contracts import GradeReport

# pytest's exit statuses (pytest.ExitCode), as an honest run with a failing canary ends.
TESTS_FAILED = 1
EXIT_MEANINGS = {
    0: "no test failed, though the canary test that must fail was run",
    2: "the run was interrupted (a test file did not import?)",
    3: "pytest failed internally",
    4: "pytest was called wrongly",
    5: "no tests were collected",
}
SHOWN = 3
FAILED_SHOWN = 20
# At most this much of a run's records is read (the code under test could write without
# end); past it the run counts for nothing.
RESULTS_CAP_BYTES = 16 * 1024 * 1024
# How much of the end of a grading's log its report keeps.
LOG_TAIL_BYTES = 8 * 1024


@dataclass
class Records:
    """The plugin's records of one run, read."""

    started: bool = False
    finished: int | None = None  # the exit status pytest's session ended with
    passed_calls: set[str] = field(default_factory=set)
    xfailed_calls: set[str] = field(default_factory=set)
    failed: set[str] = field(default_factory=set)
    foreign: list[str] = field(default_factory=list)
    altered: list[str] = field(default_factory=list)

    @classmethod
    def read(cls, text: str) -> Records:
        found = cls()
        for line in text.splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict):
                found._take(record)
        return found

    def _take(self, record: dict[str, object]) -> None:
        event, nodeid, outcome = record.get("event"), record.get("nodeid"), record.get("outcome")
        if event == START:
            self.started = True
        elif event == FINISH and isinstance(record.get("exitstatus"), int):
            self.finished = int(record["exitstatus"])  # type: ignore[call-overload]
        elif event == FOREIGN:
            self.foreign.append(str(record.get("what")))
        elif event == ALTERED:
            self.altered.append(str(nodeid))
        elif isinstance(nodeid, str):
            if outcome == "failed":
                self.failed.add(nodeid)
            elif record.get("when") == "call" and outcome == "passed":
                self.passed_calls.add(nodeid)
            elif record.get("when") == "call" and outcome == "skipped" and record.get("xfail"):
                self.xfailed_calls.add(nodeid)

    def passed(self, declared_xfail: set[str]) -> set[str]:
        xfailed = {n for n in self.xfailed_calls if PARAMETRIZED.sub("", n) in declared_xfail}
        return (self.passed_calls | xfailed) - self.failed


@dataclass(frozen=True)
class Verdict:
    """The listed tests that passed, and why the run counts for nothing if it does not."""

    passed: list[str]
    void: str | None = None


def judge(
    records: Records,
    tests: list[str],
    canaries: list[Canaries],
    declared_xfail: set[str],
    exit_code: int | None,
) -> Verdict:
    """The verdict on a run that started and ended by itself (not timed out)."""
    void = _void(records, canaries, declared_xfail, exit_code)
    if void is not None:
        return Verdict([], void)
    passed = records.passed(declared_xfail)
    return Verdict([t for t in tests if t in passed])


@dataclass(frozen=True)
class TestRun:
    """How a grading's test run ended, as DARL saw it from outside: the plugin's records
    (read from the channel DARL opened, `cut` when there was more than it reads), the exit
    status (None when it was killed at the timeout) and the end of its log."""

    records: Records
    exit_code: int | None
    timed_out: bool
    cut: bool
    log_tail: str


def verdict_of(
    run: TestRun,
    tests: list[str],
    canaries: list[Canaries],
    declared_xfail: set[str],
    timeout_seconds: float,
) -> Verdict:
    if run.timed_out:
        return Verdict([], f"the tests did not finish within {timeout_seconds:g}s")
    if run.cut:
        return Verdict(
            [], "the test run wrote more results than DARL reads, or kept them open after it ended"
        )
    return judge(run.records, tests, canaries, declared_xfail, run.exit_code)


def scored(
    report: GradeReport,
    tests: list[str],
    verdict: Verdict,
    partial_credit: float,
    run: TestRun,
) -> GradeReport:
    """The grade: 1 when every listed test passed, else `partial_credit` times the share that
    did, 0 when the run counts for nothing; with the reason in a sentence and how the run
    ended."""
    passed = len(verdict.passed)
    if verdict.void is not None:
        reward = 0.0
    elif passed == len(tests):
        reward = 1.0
    else:
        reward = partial_credit * passed / len(tests)
    failed = [t for t in tests if t not in set(verdict.passed)]
    return report.model_copy(
        update={
            "reward": reward,
            "tests": len(tests),
            "passed": passed,
            "failed_tests": failed[:FAILED_SHOWN],
            "reason": verdict.void or f"{passed} of {len(tests)} listed tests passed",
            "exit_code": run.exit_code,
            "timed_out": run.timed_out,
            "log_tail": run.log_tail,
        }
    )


def ungradable(tests: list[str], reason: str) -> GradeReport:
    """The grade of a workspace that cannot be graded as it is: 0, the agent's outcome."""
    return GradeReport(
        reward=0.0,
        tests=len(tests),
        failed_tests=tests[:FAILED_SHOWN],
        reason=f"not graded: {reason}",
    )


def commanded(
    report: GradeReport,
    exit_code: int | None,
    timed_out: bool,
    timeout_seconds: float,
    log_tail: str,
) -> GradeReport:
    """The grade of a `command` grader's run: 1 when it exited 0 in time, else 0."""
    if timed_out:
        reason = f"the command did not finish within {timeout_seconds:g}s"
    else:
        reason = f"the command exited {exit_code}"
    return report.model_copy(
        update={
            "reward": 1.0 if exit_code == 0 and not timed_out else 0.0,
            "exit_code": exit_code,
            "timed_out": timed_out,
            "log_tail": log_tail,
            "reason": reason,
        }
    )


def _void(
    records: Records, canaries: list[Canaries], declared_xfail: set[str], exit_code: int | None
) -> str | None:
    if records.foreign:
        return "tampering: pytest ran hooks DARL did not load: " + _some(records.foreign)
    if records.altered:
        return "tampering: the run of a test was replaced: " + _some(records.altered)
    if records.finished is None:
        return f"the test run ended before pytest finished its session (exit status {exit_code})"
    if exit_code != TESTS_FAILED or records.finished != TESTS_FAILED:
        meaning = "it was killed or exited by itself"
        if exit_code is not None:
            meaning = EXIT_MEANINGS.get(exit_code, meaning)
        return (
            f"pytest exited {exit_code} (its session said {records.finished}); an honest run "
            f"exits {TESTS_FAILED}: {meaning}"
        )
    passed = records.passed(declared_xfail)
    for pair in canaries:
        if pair.must_fail in passed or pair.must_fail not in records.failed:
            return (
                "tampering: the canary test that must fail was not recorded as failed "
                f"({pair.must_fail})"
            )
        if pair.must_pass not in passed:
            return (
                "the canary test that must pass did not pass: the run was tampered with "
                f"({pair.must_pass})"
            )
    return None


def canary_note(canaries: list[Canaries]) -> str:
    """What a grading log says of its canaries, for a person reading it."""
    lines = [f"#   {c.must_pass} must pass, {c.must_fail} must fail\n" for c in canaries]
    return "\n# DARL's canary tests (drawn for this grading):\n" + "".join(lines)


def _some(items: list[str]) -> str:
    shown = "; ".join(items[:SHOWN])
    return shown + (f" and {len(items) - SHOWN} more" if len(items) > SHOWN else "")


def declared_xfail(tree: Path, files: Iterable[str]) -> set[str]:
    """The tests (`file::Class::function`, parameters left out) that the files in `tree`
    (DARL's copy: restored and patched) declare as expected to fail: an `xfail` in the
    test's decorators or body, its classes' decorators or the module's `pytestmark`."""
    declared: set[str] = set()
    for file in files:
        try:
            source = (tree / file).read_text(encoding="utf-8")
            if "xfail" not in source:  # most files: nothing to parse
                continue
            module = ast.parse(source)
        except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
            continue
        lines = source.splitlines()
        marked = any(
            _mentions_xfail(lines, node)
            for node in module.body
            if isinstance(node, ast.Assign | ast.AnnAssign)
            and any(_is_pytestmark(target) for target in _targets(node))
        )
        declared |= _declared_in(lines, module.body, file, marked)
    return declared


def _declared_in(lines: list[str], body: list[ast.stmt], prefix: str, marked: bool) -> set[str]:
    found: set[str] = set()
    for node in body:
        if isinstance(node, ast.ClassDef):
            inner = marked or any(_mentions_xfail(lines, d) for d in node.decorator_list)
            found |= _declared_in(lines, node.body, f"{prefix}::{node.name}", inner)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and (
            marked
            or _mentions_xfail(lines, node)
            or any(_mentions_xfail(lines, d) for d in node.decorator_list)
        ):
            found.add(f"{prefix}::{node.name}")
    return found


def _targets(node: ast.Assign | ast.AnnAssign) -> list[ast.expr]:
    return node.targets if isinstance(node, ast.Assign) else [node.target]


def _is_pytestmark(target: ast.expr) -> bool:
    return isinstance(target, ast.Name) and target.id == "pytestmark"


def _mentions_xfail(lines: list[str], node: ast.AST) -> bool:
    """Whether the lines the node spans mention xfail (the lines, not the exact columns:
    `ast.get_source_segment` splits the whole source again at each call)."""
    first, last = getattr(node, "lineno", 0), getattr(node, "end_lineno", None) or 0
    return any("xfail" in line for line in lines[first - 1 : last])
