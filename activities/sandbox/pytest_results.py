"""DARL's pytest plugin for grading, run as the grading command itself: it imports pytest
before the repository is on sys.path (so nothing in it can stand in for pytest), then puts the
repository first and runs pytest with itself as a plugin, which records each test's outcome,
per node id and phase, as JSON lines in a file outside the workspace. The grader reads only
that file: never a report in the workspace, never the exit status alone.

Standalone (pytest and the standard library): the sandbox sees this one file.

    python -I -B pytest_results.py --results FILE --root DIR -- PYTEST ARGS...
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import IO, Any

_results: IO[str] | None = None


def _record(record: dict[str, Any]) -> None:
    if _results is not None:
        _results.write(json.dumps(record) + "\n")


def pytest_runtest_logreport(report: Any) -> None:
    _record(
        {
            "nodeid": report.nodeid,
            "when": report.when,
            "outcome": report.outcome,
            "xfail": hasattr(report, "wasxfail"),
        }
    )


def pytest_collectreport(report: Any) -> None:
    if report.failed:
        _record({"nodeid": report.nodeid, "when": "collect", "outcome": "failed"})


def main(argv: Sequence[str]) -> int:
    global _results
    if len(argv) < 5 or argv[0] != "--results" or argv[2] != "--root" or argv[4] != "--":
        sys.stderr.write("usage: pytest_results.py --results FILE --root DIR -- ARGS\n")
        return 2
    results, root, pytest_args = argv[1], argv[3], list(argv[5:])
    import pytest

    _results = open(results, "a", buffering=1)  # noqa: SIM115 - open for the whole run
    # Nothing of the repository has run yet: what fails from here on is the repository's.
    _record({"event": "pytest"})
    sys.path.insert(0, root)
    return int(pytest.main(pytest_args, plugins=[sys.modules[__name__]]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
