"""DARL's plugin for agents that are Temporal workflows (darl.temporal_agents) is tested where
such agents' workers run: in .venv-temporal-agents, whose OpenAI Agents and LangGraph
integrations DARL's own venv cannot import. This runs those tests (tests/temporal_agents, in
Temporal's time-skipping test server with a stub gateway) there, as a process of their own."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
AGENTS_PYTHON = ROOT / ".venv-temporal-agents" / "bin" / "python"
TESTS = ROOT / "tests" / "temporal_agents"
# Under the main suite's per-test timeout (pyproject's [tool.pytest.ini_options]).
RUN_TIMEOUT_S = 240


@pytest.mark.skipif(
    not AGENTS_PYTHON.exists(), reason="needs .venv-temporal-agents (make temporal-agents)"
)
def test_the_plugins_tests_pass_in_the_agents_venv() -> None:
    # tests/temporal_agents/pytest.ini makes that folder the rootdir: this suite's conftest
    # (DARL's venv and data converter) and its pytest settings stay out of the run.
    run = subprocess.run(
        [str(AGENTS_PYTHON), "-m", "pytest", "-q", "-p", "no:cacheprovider", str(TESTS)],
        cwd=ROOT,
        env={**os.environ, "OPENAI_AGENTS_DISABLE_TRACING": "1"},
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        check=False,
    )
    assert run.returncode == 0, f"{run.stdout}\n{run.stderr}"
    assert " passed" in run.stdout.splitlines()[-1], run.stdout
