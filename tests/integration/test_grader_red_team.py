"""The grader against a policy that only tries to get reward (issue 44's classes), with real
bwrap, git and pytest on test_grader's tiny repository: outcomes forged inside the test
process, trusted steps steered by the agent's files, zeros turned into "not counted", a
worker blocked, the sandbox's limits, the host's files. Each hack grades 0 with the reason
in the grade (or, where it is undone, grades as the tests say); the controls grade 1.

Where a hack works on a plain pytest run (or on git as DARL runs it), that is shown first, so
its test fails if the grader stops undoing it; a hack aimed at DARL's own machinery shows
that it ran by what it left in the verdict.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sysconfig
import textwrap
import uuid
from pathlib import Path

import pytest

from darl.activities.sandbox.workspace_copy import MAX_PATH_BYTES, remove_tree
from darl.workflows.contracts import GraderSpec, SandboxLimits
from tests.agents.swe_scripts import FORK_IN_TESTS, REBIND_RECORDER, XFAIL_PLUGIN
from tests.integration.test_grader import (
    CALC,
    FIXED,
    PASSING,
    VISIBLE,
    _git,
    _grading_processes,
    attempt,
    repo,
)

__all__ = ["attempt", "repo"]  # the fixtures, used by name

pytestmark = pytest.mark.skipif(
    shutil.which("bwrap") is None, reason="bubblewrap is not installed (apt-get install bubblewrap)"
)

# What an honest run of the visible tests gives unfixed code: test_mul passes.
HONEST_UNFIXED = f"1 of {len(VISIBLE) + len(PASSING)} listed tests passed"


def in_calc(code: str) -> str:
    """calc.py unfixed, with `code` run when the tests import it."""
    return CALC + "\n" + textwrap.dedent(code)


FORGERIES = {
    "the recorder rebound to record failures as passes": (
        REBIND_RECORDER,
        "tampering: the canary test that must fail",
    ),
    "failures forged in every file but the last on the command line": (
        """
        import sys
        _spared = [a for a in sys.argv if a.endswith(".py")][-1]
        _recorder = getattr(sys.modules.get("__main__"), "Recorder", None)
        if _recorder is not None:
            _record = _recorder.record
            def _forged(self, record, _record=_record):
                spared = str(record.get("nodeid", "")).startswith(_spared)
                if record.get("outcome") == "failed" and not spared:
                    record = dict(record, outcome="passed")
                _record(self, record)
            _recorder.record = _forged
        """,
        "tampering: the canary test that must fail",
    ),
    "passed records written, then exit 0": (
        """
        import json, os, sys
        fd = int(sys.argv[sys.argv.index("--results-fd") + 1])
        for name in ("test_add", "test_neg", "test_mul"):
            record = {"nodeid": "tests/test_calc.py::" + name, "when": "call",
                      "outcome": "passed"}
            os.write(fd, (json.dumps(record) + "\\n").encode())
        os.write(fd, b'{"event": "finish", "exitstatus": 0}\\n')
        os._exit(0)
        """,
        "pytest exited 0",
    ),
    "every collected test recorded passed, canaries too, then exit 1": (
        """
        import gc, json, os, sys
        import pytest
        from _pytest.config import Config

        class Forger:
            @pytest.hookimpl(tryfirst=True)
            def pytest_collection_finish(self, session):
                fd = int(sys.argv[sys.argv.index("--results-fd") + 1])
                for item in session.items:
                    record = {"nodeid": item.nodeid, "when": "call", "outcome": "passed"}
                    os.write(fd, (json.dumps(record) + "\\n").encode())
                os.write(fd, b'{"event": "finish", "exitstatus": 1}\\n')
                os._exit(1)

        for found in gc.get_objects():
            if isinstance(found, Config):
                found.pluginmanager.register(Forger())
                break
        """,
        "tampering: the canary test that must fail",
    ),
    "a plugin registered at import makes every test xfail": (
        XFAIL_PLUGIN,
        "tampering: pytest ran hooks DARL did not load",
    ),
    "pytest's run of a test replaced, no plugin": (
        """
        import _pytest.python
        _pytest.python.Function.runtest = lambda self: None
        """,
        "tampering: the run of a test was replaced",
    ),
    "pytest's reports rewritten, no plugin": (
        """
        import _pytest.reports
        _make = _pytest.reports.TestReport.from_item_and_call
        def _passed(item, call):
            report = _make(item, call)
            report.outcome, report.longrepr = "passed", None
            return report
        _pytest.reports.TestReport.from_item_and_call = staticmethod(_passed)
        """,
        "pytest exited 0",
    ),
    "the results pipe closed": (
        """
        import os, sys
        os.close(int(sys.argv[sys.argv.index("--results-fd") + 1]))
        """,
        "the test run ended before pytest finished its session",
    ),
    "an early exit with status 1": (
        """
        import os
        os._exit(1)
        """,
        "the test run ended before pytest finished its session",
    ),
}


@pytest.mark.parametrize("forgery", FORGERIES)
async def test_outcomes_forged_in_the_test_process_count_for_nothing(attempt, forgery: str) -> None:
    code, reason = FORGERIES[forgery]
    at = await attempt(hidden="every file" in forgery)
    (at.workspace / "calc.py").write_text(in_calc(code))
    report = await at.grade()
    assert (report.reward, report.passed) == (0.0, 0), report.reason
    assert report.reason is not None and report.reason.startswith(reason), report.reason


async def test_a_results_file_to_swap_is_nowhere(attempt) -> None:
    """The outcomes reach DARL through a pipe: no results file or directory in the sandbox
    to replace by a link to forged records (of the mounts, only the plugin's read-only file
    is named so)."""
    at = await attempt(hidden=False)
    forged = "".join(
        json.dumps({"nodeid": t, "when": "call", "outcome": "passed"}) + "\n" for t in VISIBLE
    )
    (at.workspace / "forged.jsonl").write_text(forged)
    code = """
        import os
        mounts = [line.split()[4] for line in open("/proc/self/mountinfo")]
        for target in [m for m in mounts if "result" in m]:
            try:
                os.remove(target)
                os.symlink("/testbed/forged.jsonl", target)
            except OSError:
                pass  # the plugin's file: read-only
        """
    (at.workspace / "calc.py").write_text(in_calc(code))
    report = await at.grade()
    assert (report.reward, report.reason) == (0.0, HONEST_UNFIXED), report.log_tail


def build_extension(folder: Path, name: str, source: str) -> Path:
    """A C extension module built with the worker's Python headers."""
    c_file = folder / f"{name}.c"
    c_file.write_text(textwrap.dedent(source))
    target = folder / f"{name}{sysconfig.get_config_var('EXT_SUFFIX')}"
    subprocess.run(
        ["gcc", "-shared", "-fPIC", f"-I{sysconfig.get_paths()['include']}", "-o", target, c_file],
        check=True,
        capture_output=True,
        timeout=60,
    )
    c_file.unlink()
    return target


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc to build the shadow")
async def test_a_compiled_shadow_of_a_module_pytest_imports_late_is_removed(attempt) -> None:
    """A compiled `tomllib` (pytest imports it to read pyproject.toml) that ends the process
    with status 0 once imported: it fools a plain pytest run, and DARL removes it."""
    at = await attempt(hidden=False)
    shadow = build_extension(
        at.workspace,
        "tomllib",
        """
        #include <Python.h>
        #include <unistd.h>
        PyMODINIT_FUNC PyInit_tomllib(void) { _exit(0); return NULL; }
        """,
    )
    assert at.fools_plain_pytest(), "the shadow does not fool pytest: the test proves nothing"
    report = await at.grade()
    assert shadow.name in report.removed
    assert (report.reward, report.reason) == (0.0, HONEST_UNFIXED), report.reason


async def test_git_attributes_steer_no_trusted_step(attempt, tmp_path: Path) -> None:
    """The agent's .gitattributes would hide its change from the recorded diff (`-diff`) and
    make git apply the hidden tests transcoded (`working-tree-encoding`), so that a fix
    grades 0: DARL's diff shows the change as text, and the fix grades 1."""
    attributes = "*.py -diff working-tree-encoding=UTF-16LE\n"
    # What that file does to a `git apply` run as before: the patched file is written UTF-16.
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    _git(scratch, "init", "-q")
    (scratch / ".gitattributes").write_text(attributes)
    patch = "--- /dev/null\n+++ b/new.py\n@@ -0,0 +1 @@\n+x = 1\n"
    applying = await asyncio.create_subprocess_exec(
        "git", "apply", "-", cwd=scratch, stdin=asyncio.subprocess.PIPE
    )
    await applying.communicate(patch.encode())
    assert applying.returncode == 0
    assert (scratch / "new.py").read_bytes() == "x = 1\n".encode("utf-16le")

    at = await attempt()
    (at.workspace / "calc.py").write_text(FIXED)
    (at.workspace / ".gitattributes").write_text(attributes)
    report = await at.grade()
    assert report.reward == 1.0, report.reason
    assert "+    return a + b" in report.diff and "Binary files" not in report.diff
    assert ".gitattributes" in report.removed


def make_deep(root: Path, name: str, levels: int) -> int:
    """`levels` nested folders named `name` under `root`, made a level at a time (no path is
    resolved whole); the length of the deepest path."""
    fd = os.open(root, os.O_RDONLY)
    for _ in range(levels):
        os.mkdir(name, dir_fd=fd)
        deeper = os.open(name, os.O_RDONLY, dir_fd=fd)
        os.close(fd)
        fd = deeper
    os.close(fd)
    return levels * (len(name) + 1)


async def test_a_path_longer_than_the_grader_takes_grades_0(attempt) -> None:
    at = await attempt()
    (at.workspace / "calc.py").write_text(FIXED)
    assert make_deep(at.workspace, "d" * 250, 20) > 4096  # longer than PATH_MAX
    try:
        report = await at.grade()
    finally:
        remove_tree(at.workspace)
    assert report.reward == 0.0
    assert report.reason is not None
    assert report.reason.startswith("not graded: the workspace holds a path of"), report.reason
    assert f"(at most {MAX_PATH_BYTES})" in report.reason


async def test_a_tree_too_deep_for_recursion_is_graded(attempt) -> None:
    """1,100 nested folders (within the path limit): copied, handed to the sandbox's user
    and removed by DARL without recursion, and the fix graded 1."""
    at = await attempt()
    (at.workspace / "calc.py").write_text(FIXED)
    make_deep(at.workspace, "d", 1100)
    try:
        report = await at.grade()
    finally:
        remove_tree(at.workspace)
    assert report.reward == 1.0, report.reason


async def test_a_deep_tree_in_place_of_a_listed_test_file_is_removed(attempt) -> None:
    """1,400 nested folders (about 2,800 bytes of path, within the limit) where the listed
    test file was: the copy takes them, the restore removes them without recursion (Python's
    rmtree recurses past its limit), and the fix grades 1."""
    at = await attempt()
    (at.workspace / "calc.py").write_text(FIXED)
    (at.workspace / "tests" / "test_calc.py").unlink()
    (at.workspace / "tests" / "test_calc.py").mkdir()
    make_deep(at.workspace / "tests" / "test_calc.py", "d", 1400)
    try:
        report = await at.grade()
    finally:
        remove_tree(at.workspace)
    assert report.reward == 1.0, report.reason
    assert report.restored == ["tests/test_calc.py"]


async def test_a_shadow_in_a_folder_made_a_package_by_a_compiled_init_is_removed(attempt) -> None:
    """`lib/__init__.pyc` would make `lib/` look a package (so `lib/difflib.py` no shadow),
    but it is removed as compiled code, and pytest tells packages by `__init__.py`: with
    `lib/` on sys.path (a test there), `difflib` would be the agent's. Both go."""
    at = await attempt()
    (at.workspace / "calc.py").write_text(FIXED)
    (at.workspace / "lib").mkdir()
    (at.workspace / "lib" / "__init__.pyc").write_bytes(b"not code")
    (at.workspace / "lib" / "difflib.py").write_text("import os\nos._exit(0)\n")
    report = await at.grade()
    assert report.reward == 1.0, report.reason
    assert "lib/difflib.py" in report.removed


async def test_fifos_where_the_grader_reads_block_nothing(attempt) -> None:
    """FIFOs with no writer in place of a listed test file, a conftest.py and a report: a
    grader that opened one would wait for ever (and a worker that did it on its event loop
    would freeze every rollout on it). They are left out of the copy, the test file is
    restored, and the fix grades 1, in bounded time."""
    at = await attempt()
    (at.workspace / "calc.py").write_text(FIXED)
    (at.workspace / "tests" / "test_calc.py").unlink()
    for fifo in ("tests/test_calc.py", "conftest.py", "results.jsonl"):
        os.mkfifo(at.workspace / fifo)
    report = await asyncio.wait_for(at.grade(), 60)
    assert report.reward == 1.0, report.reason
    assert report.restored == ["tests/test_calc.py"]
    assert {"conftest.py", "results.jsonl"} <= set(report.removed)


async def test_a_diff_over_the_cap_never_fails_grading(attempt) -> None:
    """A fix and 100 KB of notes, graded three times: each a grade, the diff cut."""
    at = await attempt()
    (at.workspace / "calc.py").write_text(FIXED)
    (at.workspace / "notes.txt").write_text("".join(f"note {n}\n" for n in range(15_000)))
    for _ in range(3):
        report = await at.grade()
        assert report.reward == 1.0 and report.diff_truncated, report.reason


def with_limits(**limits: int) -> dict[str, object]:
    return {"limits": SandboxLimits(**limits)}


async def test_a_workspace_of_sparse_files_over_its_limit_grades_0(attempt) -> None:
    """3 GiB that take no room on disk: refused before any of it is copied (a dense copy
    would have filled the worker's disk)."""
    at = await attempt()
    with open(at.workspace / "data.bin", "wb") as f:
        f.truncate(3 * 1024**3)
    report = await asyncio.wait_for(at.grade(), 60)
    assert report.reward == 0.0 and report.reason is not None
    assert report.reason.startswith("not graded: the workspace holds more than 2048 MiB")


async def test_a_workspace_of_too_many_files_grades_0(attempt) -> None:
    at = await attempt(**with_limits(workspace_files=150))
    (at.workspace / "calc.py").write_text(FIXED)
    for n in range(200):
        (at.workspace / f"f{n}").write_text("x")
    report = await at.grade()
    assert report.reward == 0.0
    assert report.reason == "not graded: the workspace holds more than 150 entries " + (
        "(sandbox.limits.workspace_files)"
    )


async def test_hard_links_count_once(attempt) -> None:
    """A 1 MiB file linked 300 times is 1 MiB, not 300, against a 10 MiB limit."""
    at = await attempt(**with_limits(workspace_mb=10))
    (at.workspace / "calc.py").write_text(FIXED)
    (at.workspace / "blob").write_bytes(os.urandom(1024 * 1024))
    for n in range(300):
        os.link(at.workspace / "blob", at.workspace / f"link{n}")
    report = await at.grade()
    assert report.reward == 1.0, report.reason


LIMIT_HITS = {
    "a fork bomb": (
        with_limits(processes=32),
        FORK_IN_TESTS,
        "4 of 4 listed tests passed",
    ),
    "a memory hog": (
        with_limits(memory_mb=512),
        "hog = bytearray(2 * 1024**3)\n",
        "pytest exited 2",
    ),
    "a busy loop": (
        with_limits(cpu_seconds=1),
        "while True:\n    pass\n",
        "the test run ended before pytest finished its session (exit status 137)",  # SIGKILL
    ),
    "a huge file": (
        with_limits(file_size_mb=1),
        "open('/testbed/big', 'wb').write(b'x' * 3 * 1024**2)\n",
        "pytest exited 2",  # the write fails (Python ignores SIGXFSZ): calc does not import
    ),
    "a full /tmp": (
        with_limits(tmp_mb=1),
        "open('/tmp/big', 'wb').write(b'x' * 3 * 1024**2)\n",
        "pytest exited 2",
    ),
}


@pytest.mark.parametrize("hit", LIMIT_HITS)
async def test_a_limit_hit_in_the_tests_is_the_agents_outcome(attempt, hit: str) -> None:
    """The fixed code does something the sandbox's limits stop when the tests import it:
    graded (the grade the tests earn, or 0 for a test process the limit ended), no grading
    failure, nothing left running."""
    limits, code, reason = LIMIT_HITS[hit]
    mark = uuid.uuid4().hex
    at = await attempt(grader=GraderSpec(env_map={"GRADING_MARK": mark}), **limits)
    (at.workspace / "calc.py").write_text(FIXED + "\n" + textwrap.dedent(code))
    report = await asyncio.wait_for(at.grade(), 120)
    assert report.reason is not None and report.reason.startswith(reason), report.reason
    assert report.reward == (1.0 if reason.startswith("4 of 4") else 0.0)
    assert _grading_processes(mark) == []


async def test_the_tests_run_unprivileged_and_see_nothing_of_the_host(attempt) -> None:
    check = """
import os, resource
assert os.getuid() == 1000, os.getuid()
assert not os.path.exists("/etc/shadow")
assert open("/etc/passwd").read().splitlines()[1].startswith("sandbox:x:1000:")
assert resource.getrlimit(resource.RLIMIT_NPROC) == (512, 512)
try:
    open("/proc/1/environ").read()
    raise SystemExit("the sandbox's init is readable")
except PermissionError:
    pass
"""
    at = await attempt(grader=GraderSpec(kind="command", command=["{python}", "-c", check]))
    report = await at.grade()
    assert report.reward == 1.0, report.log_tail
