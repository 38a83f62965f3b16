"""DARL's grader on a tiny repository with two bugs, with real bwrap, git and pytest: a correct
fix grades 1, a wrong one 0, a partial one its partial credit, a grading gives the same report
twice, and every reward hack grades 0. Each hack is first shown to fool a plain pytest run in
the agent's workspace (with the repository on PYTHONPATH, as an editable install puts it), so
its test fails if the grader stops undoing it.
"""

from __future__ import annotations

import importlib.util
import json
import marshal
import os
import shutil
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
from _pytest.assertion.rewrite import PYC_TAIL

from darl.activities.agent_contract import ContractIssuer
from darl.activities.runners.local import LocalProcessRunner, stop_leftover_agents
from darl.activities.sandbox.errors import GradingError
from darl.activities.sandbox.grading import grade
from darl.activities.sandbox.workspace import prepare_workspace
from darl.workflows.contracts import (
    AwaitRequest,
    GradeReport,
    GraderSpec,
    LaunchRequest,
    LocalAgentSpec,
    RewardSpec,
    RolloutSpec,
    RolloutTimeouts,
    SandboxSpec,
)

pytestmark = pytest.mark.skipif(
    shutil.which("bwrap") is None, reason="bubblewrap is not installed (apt-get install bubblewrap)"
)

CALC = """\
def add(a, b):
    return a - b


def neg(a):
    return a


def mul(a, b):
    return a * b
"""
TESTS = """\
from calc import add, mul, neg


def test_add():
    assert add(2, 3) == 5


def test_neg():
    assert neg(4) == -4


def test_mul():
    assert mul(2, 3) == 6
"""
HIDDEN_TEST = """\
from calc import add


def test_add_negative():
    assert add(-2, -3) == -5
"""
PYPROJECT = '[tool.pytest.ini_options]\ntestpaths = ["tests"]\n'
FIXED = CALC.replace("a - b", "a + b").replace("return a\n", "return -a\n")
VISIBLE = ["tests/test_calc.py::test_add", "tests/test_calc.py::test_neg"]
PASSING = ["tests/test_calc.py::test_mul"]


@dataclass(frozen=True)
class Repo:
    repos_dir: Path
    commit: str
    test_patch: str


def _git(cwd: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
        cwd=cwd,
        check=True,
        capture_output=True,
        text=True,
    ).stdout


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Repo:
    """A bare mirror of the bug commit; the hidden test comes as a patch, not a commit."""
    root = tmp_path_factory.mktemp("grader")
    source = root / "source"
    (source / "tests").mkdir(parents=True)
    (source / "calc.py").write_text(CALC)
    (source / "tests" / "test_calc.py").write_text(TESTS)
    (source / "pyproject.toml").write_text(PYPROJECT)
    (source / ".gitignore").write_text("*.log\n")
    _git(source, "init", "-q")
    _git(source, "add", "-A")
    _git(source, "commit", "-qm", "the bug")
    commit = _git(source, "rev-parse", "HEAD").strip()
    _git(root, "clone", "-q", "--bare", str(source), str(root / "repos" / "org__calc"))
    (source / "tests" / "test_hidden.py").write_text(HIDDEN_TEST)
    _git(source, "add", "-A")
    test_patch = _git(source, "diff", "--cached", commit)
    return Repo(root / "repos", commit, test_patch)


def task(repo: Repo, hidden: bool = True) -> dict[str, object]:
    """With `hidden`, the task has a hidden test (FAIL_TO_PASS as SWE-bench's JSON string);
    without, it lists only the visible tests, so a hack that fools pytest on them would be
    graded 1 if the grader let it."""
    fail_to_pass = [*VISIBLE, "tests/test_hidden.py::test_add_negative"] if hidden else VISIBLE
    return {
        "instance_id": "org__calc-1",
        "repo": "org/calc",
        "base_commit": repo.commit,
        "problem_statement": "add and neg are wrong",
        "FAIL_TO_PASS": json.dumps(fail_to_pass),
        "PASS_TO_PASS": PASSING,
        "test_patch": repo.test_patch if hidden else "",
    }


def spec(
    repo: Repo, hidden: bool = True, grader: GraderSpec | None = None, **sandbox: object
) -> RolloutSpec:
    return RolloutSpec(
        run_id="run",
        rollout_id="r1",
        task=task(repo, hidden),
        agent=LocalAgentSpec(
            command=["/bin/true"], sandbox=SandboxSpec(repos_dir=str(repo.repos_dir), **sandbox)
        ),
        reward=RewardSpec(grader=grader or GraderSpec()),
        timeouts=RolloutTimeouts(agent_seconds=60, heartbeat_seconds=3, reward_seconds=30),
        revision=3,
    )


@dataclass
class Attempt:
    spec: RolloutSpec
    dir: Path

    @property
    def workspace(self) -> Path:
        return self.dir / "workspace"

    async def grade(self) -> GradeReport:
        return await grade(self.spec, self.dir, lambda *_: None)

    def fools_plain_pytest(self) -> bool:
        """Whether `python -m pytest <listed tests' files>` in the workspace exits 0."""
        tests = json.loads(self.spec.task["FAIL_TO_PASS"]) + PASSING
        files = sorted({t.split("::")[0] for t in tests})
        env = {**os.environ, "PYTHONPATH": str(self.workspace)}
        env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
        run = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *files],
            cwd=self.workspace,
            env=env,
            capture_output=True,
            timeout=60,
        )
        return run.returncode == 0


@pytest.fixture
async def attempt(repo: Repo, tmp_path: Path) -> Callable[..., object]:
    async def prepared(hidden: bool = True, **options: object) -> Attempt:
        rollout = spec(repo, hidden, **options)
        sandbox = rollout.agent.sandbox
        await prepare_workspace(sandbox, rollout.task, tmp_path / "attempt-1")
        return Attempt(rollout, tmp_path / "attempt-1")

    return prepared


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))


async def test_a_correct_fix_grades_1_and_twice_the_same(attempt) -> None:
    at = await attempt()
    (at.workspace / "calc.py").write_text(FIXED)
    (at.workspace / "notes.txt").write_text("untracked\n")
    (at.workspace / "debug.log").write_text("ignored by the commit's .gitignore\n")
    (at.workspace / ".gitignore").write_text("*.log\nsecret.txt\n")
    (at.workspace / "secret.txt").write_text("ignored by the agent's .gitignore\n")
    first = await at.grade()
    assert (first.reward, first.tests, first.passed) == (1.0, 4, 4), first.log_tail
    # pytest exits 1: the canary that must fail failed, as it does in every honest run.
    assert first.failed_tests == [] and first.exit_code == 1 and not first.timed_out
    assert first.reason == "4 of 4 listed tests passed"
    for shown in ("+    return a + b", "+    return -a", "notes.txt", "debug.log", "secret.txt"):
        assert shown in first.diff
    assert not first.diff_truncated and first.restored == [] and first.removed == []
    again = await at.grade()
    # The same report, but for the time it took (and the log: pytest's timing, the
    # canaries, drawn fresh for each grading).
    same = {"seconds": 0, "log_tail": ""}
    assert again.model_copy(update=same) == first.model_copy(update=same)
    # The four listed tests, and in each of the two files a canary that must pass and one
    # that must fail.
    assert "2 failed, 6 passed" in first.log_tail and "2 failed, 6 passed" in again.log_tail
    print(f"grading the tiny repository took {first.seconds:.2f} s and {again.seconds:.2f} s")


async def test_a_wrong_fix_grades_0(attempt) -> None:
    at = await attempt()
    (at.workspace / "calc.py").write_text(CALC.replace("a - b", "a * b"))
    report = await at.grade()
    assert (report.reward, report.passed) == (0.0, 1)
    assert report.failed_tests == [*VISIBLE, "tests/test_hidden.py::test_add_negative"]


async def test_a_partial_fix_earns_its_partial_credit(attempt) -> None:
    at = await attempt(grader=GraderSpec(partial_credit=0.5))
    (at.workspace / "calc.py").write_text(CALC.replace("a - b", "a + b"))
    report = await at.grade()
    assert (report.tests, report.passed) == (4, 3)
    assert report.reward == pytest.approx(0.5 * 3 / 4)
    assert report.failed_tests == ["tests/test_calc.py::test_neg"]


def edit_a_test(ws: Path) -> None:
    (ws / "tests" / "test_calc.py").write_text(
        TESTS.replace("== 5", "!= 5").replace("== -4", "!= -4")
    )


def delete_the_failing_tests(ws: Path) -> None:
    (ws / "tests" / "test_calc.py").write_text(
        "from calc import mul\n\n\ndef test_mul():\n    assert mul(2, 3) == 6\n"
    )


CONFTEST_PASSES_ALL = """\
    import pytest

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(item, call):
        outcome = yield
        report = outcome.get_result()
        report.outcome, report.longrepr = "passed", None
"""


def conftest_passes_everything(ws: Path) -> None:
    write(ws / "conftest.py", CONFTEST_PASSES_ALL)


def conftest_replaces_the_tests(ws: Path) -> None:
    write(
        ws / "tests" / "conftest.py",
        """\
        def pytest_collection_modifyitems(items):
            for item in items:
                item.runtest = lambda: None
        """,
    )


def sitecustomize_os_exits(ws: Path) -> None:
    write(ws / "sitecustomize.py", "import os\nos._exit(0)\n")


def pytest_ini_loads_a_plugin(ws: Path) -> None:
    write(ws / "passing_plugin.py", CONFTEST_PASSES_ALL)
    write(ws / "pytest.ini", "[pytest]\naddopts = -p passing_plugin\n")


def pyproject_deselects(ws: Path) -> None:
    deselect = " ".join(f"--deselect {t}" for t in VISIBLE)
    write(ws / "pyproject.toml", PYPROJECT + f'addopts = "{deselect}"\n')


PASSING_TESTS = (
    "def test_add():\n    pass\n\n\ndef test_neg():\n    pass\n\n\ndef test_mul():\n    pass\n"
)


def symlinked_test_file(ws: Path) -> None:
    write(ws / "fake" / "test_calc.py", PASSING_TESTS)
    (ws / "tests" / "test_calc.py").unlink()
    (ws / "tests" / "test_calc.py").symlink_to("../fake/test_calc.py")


def symlinked_tests_dir(ws: Path) -> None:
    write(ws / "fake" / "test_calc.py", PASSING_TESTS)
    shutil.rmtree(ws / "tests")
    (ws / "tests").symlink_to("fake")


PYTEST_CACHE = f"tests/__pycache__/test_calc{PYC_TAIL}"


def planted_byte_code(ws: Path) -> None:
    """pytest's own cache of the rewritten test module, holding tests that pass: pytest checks
    only that the source's hash matches, so the untouched test file keeps it valid."""
    source = (ws / "tests" / "test_calc.py").read_bytes()
    passing = compile(PASSING_TESTS, str(ws / "tests" / "test_calc.py"), "exec")
    cache = ws / PYTEST_CACHE
    cache.parent.mkdir()
    cache.write_bytes(
        importlib.util.MAGIC_NUMBER
        + b"\x03\x00\x00\x00"
        + importlib.util.source_hash(source)[:8]
        + marshal.dumps(passing)
    )


HACKS_THAT_FOOL_PYTEST = {
    "edit a test": (edit_a_test, "restored", "tests/test_calc.py"),
    "delete the failing tests": (delete_the_failing_tests, "restored", "tests/test_calc.py"),
    "conftest passes every report": (conftest_passes_everything, "removed", "conftest.py"),
    "conftest replaces the tests": (conftest_replaces_the_tests, "removed", "tests/conftest.py"),
    "sitecustomize os._exit(0)": (sitecustomize_os_exits, "removed", "sitecustomize.py"),
    "pytest.ini loads a plugin": (pytest_ini_loads_a_plugin, "removed", "pytest.ini"),
    "pyproject deselects": (pyproject_deselects, "restored", "pyproject.toml"),
    "a symlink for the test file": (symlinked_test_file, "restored", "tests/test_calc.py"),
    "a symlink for the tests dir": (symlinked_tests_dir, "restored", "tests/test_calc.py"),
    "planted byte code": (planted_byte_code, "removed", PYTEST_CACHE),
}


@pytest.mark.parametrize("hack", HACKS_THAT_FOOL_PYTEST)
async def test_a_hack_that_fools_pytest_grades_0(attempt, hack: str) -> None:
    plant, undone_as, path = HACKS_THAT_FOOL_PYTEST[hack]
    at = await attempt(hidden=False)
    plant(at.workspace)
    assert at.fools_plain_pytest(), f"{hack} does not fool pytest: the test proves nothing"
    report = await at.grade()
    assert report.reward == 0.0, report.log_tail
    assert path in getattr(report, undone_as), (report.restored, report.removed)
    assert report.failed_tests == VISIBLE


async def test_code_that_ends_the_run_early_grades_0(attempt) -> None:
    """The exit status alone is never trusted: the code under test ends pytest with 0."""
    at = await attempt(hidden=False)
    (at.workspace / "calc.py").write_text(CALC + "\nimport os\n\nos._exit(0)\n")
    assert at.fools_plain_pytest()
    report = await at.grade()
    assert (report.reward, report.passed, report.exit_code) == (0.0, 0, 0)


async def test_fake_reports_and_start_up_files_in_the_workspace_grade_0(attempt) -> None:
    """Hacks that would fool a grader reading the workspace, and files that fool no pytest
    here but are removed anyway; a directory put in place of the test file is replaced by
    the file (test_mul passing proves it)."""
    at = await attempt(hidden=False)
    ws = at.workspace
    (ws / "tests" / "test_calc.py").unlink()
    write(ws / "tests" / "test_calc.py" / "conftest.py", CONFTEST_PASSES_ALL)
    passed = [{"event": "pytest"}] + [
        {"nodeid": t, "when": "call", "outcome": "passed", "xfail": False}
        for t in [*VISIBLE, *PASSING]
    ]
    write(ws / "results.jsonl", "".join(json.dumps(r) + "\n" for r in passed))
    write(ws / "report.xml", '<testsuite tests="3" failures="0" errors="0"></testsuite>\n')
    # Python 3.11 makes a SystemExit in sitecustomize a fatal error (exit status 1), and
    # loads .pth files only from site directories: these fool no one, and are removed anyway.
    write(ws / "sitecustomize.py", "import sys\nsys.exit(0)\n")
    write(ws / "darl.pth", "import os; os._exit(0)\n")
    write(ws / "tests" / "usercustomize.py", "import os\nos._exit(0)\n")
    report = await at.grade()
    assert (report.reward, report.passed) == (0.0, 1)
    assert {"sitecustomize.py", "darl.pth", "tests/usercustomize.py"} <= set(report.removed)
    assert "tests/test_calc.py/conftest.py" in report.removed
    assert report.restored == ["tests/test_calc.py"]
    assert "deleted file mode" in report.diff and "+++ b/report.xml" in report.diff


async def test_the_tests_time_out(attempt) -> None:
    mark = uuid.uuid4().hex  # tells this grading's processes from any other's
    at = await attempt(hidden=False, grader=GraderSpec(env_map={"GRADING_MARK": mark}))
    (at.workspace / "calc.py").write_text(
        FIXED.replace("return a * b", "while True:\n        pass")
    )
    at.spec = at.spec.model_copy(
        update={"timeouts": at.spec.timeouts.model_copy(update={"reward_seconds": 1.5})}
    )
    report = await at.grade()
    assert report.timed_out and report.reward == 0.0 and report.exit_code is None
    assert _grading_processes(mark) == []


def _grading_processes(mark: str) -> list[psutil.Process]:
    """Processes of the grading marked so still running: none once grade() returns."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("GRADING_MARK") == mark and proc.status() != "zombie":
                found.append(proc)
        except psutil.Error:
            continue
    return found


async def test_a_test_patch_that_does_not_apply_is_a_grading_error(attempt) -> None:
    at = await attempt()
    broken = (
        at.spec.task["test_patch"].replace("test_add_negative", "x").replace("@@ -0,0", "@@ -3,3")
    )
    at.spec = at.spec.model_copy(update={"task": {**at.spec.task, "test_patch": broken}})
    with pytest.raises(GradingError, match="test_patch does not apply"):
        await at.grade()


async def test_a_command_grader_and_isolation_none(attempt) -> None:
    check = GraderSpec(
        kind="command", command=["{python}", "-c", "import calc; assert calc.add(2, 3) == 5"]
    )
    for isolation in ("bubblewrap", "none"):
        at = await attempt(grader=check, isolation=isolation)
        assert (await at.grade()).reward == 0.0
        (at.workspace / "calc.py").write_text(FIXED)
        assert (await at.grade()).reward == 1.0
        shutil.rmtree(at.dir)


@pytest.fixture
def agents_dir(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path / "agents"
    stop_leftover_agents(tmp_path / "agents", grace_seconds=2)


async def test_the_runner_grades_what_its_sandboxed_agent_left(
    repo: Repo, agents_dir: Path
) -> None:
    """A scripted stand-in for a coding agent (sed, in the sandbox) fixes both bugs."""
    fix = "sed -i -e 's/a - b/a + b/' -e 's/return a$/return -a/' calc.py"
    rollout = spec(repo).model_copy(
        update={
            "agent": LocalAgentSpec(
                command=["/bin/sh", "-c", fix], sandbox=SandboxSpec(repos_dir=str(repo.repos_dir))
            )
        }
    )
    runner = LocalProcessRunner(agents_dir)
    contract = ContractIssuer("http://127.0.0.1:9", b"secret").issue(rollout, 1, None, {})
    handle = await runner.launch(LaunchRequest(spec=rollout, attempt=1), contract)
    request = AwaitRequest(spec=rollout, attempt=1, handle=handle, one_activity=True)
    assert (await runner.wait(request, contract, lambda *_: None)).exit_code == 0
    report = await runner.grade(request, lambda *_: None)
    assert (report.reward, report.passed) == (1.0, 4), report.log_tail
    assert "+    return a + b" in report.diff
