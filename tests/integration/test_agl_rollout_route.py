"""Agent Lightning's rollout route, `GET /api/rollouts/{rollout_id}`, on the real gateway: an
agent that reads its task as Agent Lightning's `swe_smith` agent does (the URL built from
`AGL_EVENT_URL`, `AGL_KEY` as its key: tests/agents/agl_rollout_reader.py) gets the rollout in
Agent Lightning's shape, its `input` the SWE task without the grader's hidden fields; the route
opens to the rollout's own token only, and says so of a rollout that does not exist."""

from __future__ import annotations

import asyncio
import subprocess
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from darl.workflows.contracts import (
    CURRENT_REVISION,
    GraderSpec,
    LocalAgentSpec,
    RewardSpec,
    RolloutSpec,
    RolloutTimeouts,
    SandboxSpec,
)
from darl.workflows.rollout_status import RolloutStatus
from tests.integration.stack import Stack

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
READER = ROOT / "tests" / "agents" / "agl_rollout_reader.py"
REPO = "demo/calc"
HIDDEN = {"patch": "diff --git a/calc.py b/calc.py (the gold fix)", "test_patch": "(hidden tests)"}


def git(cwd: Path, *args: str) -> str:
    ran = subprocess.run(
        ["git", "-c", "user.name=darl", "-c", "user.email=darl@example.com", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    )
    return ran.stdout.strip()


@pytest.fixture(scope="module")
def repos_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SWE-smith's mirror naming: `<repos_dir>/demo__calc`, a repository of one commit."""
    repos = tmp_path_factory.mktemp("repos")
    repo = repos / REPO.replace("/", "__")
    repo.mkdir()
    git(repo, "init", "--quiet")
    (repo / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    git(repo, "add", "calc.py")
    git(repo, "commit", "--quiet", "-m", "calc")
    return repos


def swe_task(repos_dir: Path) -> dict[str, Any]:
    commit = git(repos_dir / REPO.replace("/", "__"), "rev-parse", "HEAD")
    return {
        "instance_id": "demo__calc.1",
        "repo": REPO,
        "base_commit": commit,
        "problem_statement": "add() subtracts.",
        "FAIL_TO_PASS": ["tests/test_calc.py::test_add"],
        "PASS_TO_PASS": ["tests/test_calc.py::test_import"],
        **HIDDEN,
    }


def rollout_url(stack: Stack, rollout_id: str) -> str:
    return f"{stack.gateway_url}/api/rollouts/{rollout_id}"


async def test_an_agl_agent_reads_its_task_without_the_hidden_fields(
    stack: Stack, repos_dir: Path
) -> None:
    task = swe_task(repos_dir)
    spec = RolloutSpec(
        run_id="agl-rollout",
        rollout_id=f"agl-rollout-{uuid.uuid4().hex[:8]}",
        task=task,
        agent=LocalAgentSpec(
            command=["{python}", str(READER)],
            sandbox=SandboxSpec(repos_dir=str(repos_dir), isolation="none"),
        ),
        # Agent Lightning's swe_smith agent reads FAIL_TO_PASS, which the grader hides by
        # default (an agent that knows the graded tests can forge exactly those): shown here.
        reward=RewardSpec(
            grader=GraderSpec(
                kind="command", command=["true"], hidden_fields=["patch", "test_patch"]
            )
        ),
        timeouts=RolloutTimeouts(agent_seconds=120),
        revision=CURRENT_REVISION,
    )
    handle = await stack.start_rollout(spec)
    result = await asyncio.wait_for(handle.result(), 180)

    events = await stack.store().events(spec.rollout_id, 1)
    [read] = [e["data"]["payload"] for e in events if e["event_type"] == "task_read"]
    seen = {k: v for k, v in task.items() if k not in HIDDEN}
    assert read["rollout"]["input"] == seen == spec.agent_task()
    assert read["attempts"] == ["1"]
    rollout = read["rollout"]
    assert (rollout["rollout_id"], rollout["is_train"]) == (spec.rollout_id, True)
    assert rollout["config"] == {"timeout_seconds": 120, "local": None, "k8s": None}
    assert rollout["metadata"]["run_id"] == "agl-rollout"
    assert (rollout["status"]["state"], rollout["status"]["last_attempt_id"]) == ("running", "1")
    # It found FAIL_TO_PASS (it exits 1 without), so the rollout went on to its grading.
    assert (result.status, result.exit_code, result.reward) == (RolloutStatus.SUCCEEDED, 0, 1.0)


async def test_only_the_rollouts_own_token_reads_it(stack: Stack) -> None:
    rollout = await stack.start_idle_rollout("agl-rollout-scope")
    other = await stack.start_idle_rollout("agl-rollout-other")
    unknown = f"agl-rollout-{uuid.uuid4().hex[:8]}"
    async with httpx.AsyncClient(timeout=30) as http:
        own = await http.get(
            rollout_url(stack, rollout), headers={"x-api-key": stack.token(rollout)}
        )
        assert own.status_code == 200, own.text
        assert own.json()["rollout"]["input"] == {}  # the idle rollout's task, whole
        refusals = [
            (rollout, {"Authorization": f"Bearer {stack.token(other)}"}, 403, "forbidden"),
            (rollout, {}, 401, "invalid_token"),
            (unknown, {"Authorization": f"Bearer {stack.token(unknown)}"}, 404, "unknown_rollout"),
        ]
        for rollout_id, headers, status, code in refusals:
            answer = await http.get(rollout_url(stack, rollout_id), headers=headers)
            assert (answer.status_code, answer.json()["error"]["code"]) == (status, code)
        assert answer.json()["error"]["message"] == f"unknown rollout {unknown}"
