"""DARL's pytest plugin for grading, run as the grading command itself: it imports pytest
before the repository is on sys.path (so nothing in it can stand in for pytest), then puts the
repository first and runs pytest with itself as a plugin, which writes each test's outcome, per
node id and phase, as JSON lines to a pipe the grader opened outside the sandbox (no path the
tests could write, swap or block). It also says what it saw of the run's integrity: hook
implementations that neither pytest, an installed plugin nor a conftest.py of the repository
registered, and test items whose run was replaced; and the session's own end.

The grader never takes these records alone for a pass: the code under test runs in this
process and could write any record, so the grader also plants canary tests (one that must
fail, one that must pass), checks the exit status and the session's end (`canaries`,
`outcomes`).

Standalone (pytest and the standard library): the sandbox sees this one file.

    python -I -B pytest_results.py --results-fd N --root DIR -- PYTEST ARGS...
    python -I -B pytest_results.py --results-fd N --root DIR --args-file ARGS.json
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from typing import Any

START, FOREIGN, ALTERED, FINISH = "pytest", "foreign", "altered", "finish"
USAGE = (
    "usage: pytest_results.py --results-fd N --root DIR -- ARGS\n"
    "       pytest_results.py --results-fd N --root DIR --args-file ARGS.json\n"
    "       pytest_results.py --check   (exits 0 when this Python can run pytest)\n"
)


class Recorder:
    """The plugin: writes records to the results descriptor (`fd`)."""

    def __init__(self, fd: int, root: str) -> None:
        self._fd, self._root = fd, os.path.realpath(root)
        self._trusted: set[int] = set()
        self._trusted_prefixes = tuple(
            os.path.realpath(p) + os.sep for p in {sys.prefix, sys.base_prefix, sys.exec_prefix}
        )

    def record(self, record: dict[str, Any]) -> None:
        view = memoryview(json.dumps(record).encode() + b"\n")
        try:
            while view:
                view = view[os.write(self._fd, view) :]
        except OSError:  # the grader stopped reading: nothing more can count
            pass

    # --- what pytest calls -------------------------------------------------------------

    def pytest_load_initial_conftests(self, early_config: Any) -> None:
        """Before any conftest.py (and so any of the repository's code) is imported: every
        hook implementation registered now is pytest's, an installed plugin's or DARL's."""
        self._trusted = {id(i.function) for i in _hookimpls(early_config.pluginmanager)}

    def pytest_runtest_protocol(self, item: Any) -> None:
        replaced = "runtest" in vars(item) or not self._trusted_code(type(item).runtest)
        if replaced:
            self.record({"event": ALTERED, "nodeid": item.nodeid, "what": "its runtest"})

    def pytest_runtest_logreport(self, report: Any) -> None:
        self.record(
            {
                "nodeid": report.nodeid,
                "when": report.when,
                "outcome": report.outcome,
                "xfail": hasattr(report, "wasxfail"),
            }
        )

    def pytest_collectreport(self, report: Any) -> None:
        if report.failed:
            self.record({"nodeid": report.nodeid, "when": "collect", "outcome": "failed"})

    def pytest_sessionfinish(self, session: Any, exitstatus: Any) -> None:
        for what in self._foreign(session.config.pluginmanager):
            self.record({"event": FOREIGN, "what": what})
        self.record({"event": FINISH, "exitstatus": int(exitstatus)})

    # --- integrity -------------------------------------------------------------------

    def _foreign(self, plugins: Any) -> list[str]:
        """Hook implementations registered after the initial conftests began to load by
        anything but pytest itself, an installed module or a conftest.py of the repository
        (DARL restored what the agent changed of those and removed what it added)."""
        found = []
        for impl in _hookimpls(plugins):
            if id(impl.function) in self._trusted or self._trusted_code(impl.function):
                continue
            where = getattr(getattr(impl.function, "__code__", None), "co_filename", "?")
            found.append(f"{impl.function.__qualname__} from {where} ({impl.plugin_name})")
        return sorted(set(found))

    def _trusted_code(self, function: Any) -> bool:
        """Whether `function` was defined by an installed module or a conftest.py of the
        repository."""
        module = sys.modules.get(getattr(function, "__module__", None) or "")
        path = getattr(module, "__file__", None)
        if not isinstance(path, str):
            return False
        real = os.path.realpath(path)
        if real.startswith(self._trusted_prefixes):
            return True
        return os.path.basename(real) == "conftest.py" and real.startswith(self._root + os.sep)


def _hookimpls(plugins: Any) -> list[Any]:
    impls = []
    for name in dir(plugins.hook):
        caller = getattr(plugins.hook, name)
        if hasattr(caller, "get_hookimpls"):
            impls += caller.get_hookimpls()
    return impls


def main(argv: Sequence[str]) -> int:
    if list(argv) == ["--check"]:
        import pytest

        return 0
    if len(argv) < 5 or argv[0] != "--results-fd" or argv[2] != "--root":
        sys.stderr.write(USAGE)
        return 2
    fd, root = int(argv[1]), argv[3]
    if argv[4] == "--":
        pytest_args = list(argv[5:])
    elif argv[4] == "--args-file" and len(argv) == 6:
        with open(argv[5]) as f:
            pytest_args = [str(arg) for arg in json.load(f)]
    else:
        sys.stderr.write(USAGE)
        return 2
    import pytest

    # Before anything else's: the snapshot of trusted hooks, and the check of an item's run.
    pytest.hookimpl(tryfirst=True)(Recorder.pytest_load_initial_conftests)
    pytest.hookimpl(tryfirst=True)(Recorder.pytest_runtest_protocol)
    # After everything else's: the session's end as pytest finally says it.
    pytest.hookimpl(trylast=True)(Recorder.pytest_sessionfinish)
    recorder = Recorder(fd, root)
    # Nothing of the repository has run yet: what fails from here on is the repository's.
    recorder.record({"event": START})
    sys.path.insert(0, root)
    return int(pytest.main(pytest_args, plugins=[recorder]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
