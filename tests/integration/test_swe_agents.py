"""Coding agents end to end: DARL's own tool-calling agent and mini-swe-agent (unchanged, from
.venv-swe), started from the shipped rollout specs (examples/swe/rollout*.json), each attempt
in a bubblewrap sandbox at its task's commit and graded by DARL's `swe_tests` grader, against
the real Temporal dev server, gateway and rollout worker. The model is the scripted policy
server, a stand-in for a model that can solve coding tasks (none runs here): it answers each
task with the tool calls of a known fix, a wrong fix, a reward hack or a long exploration
(tests/agents/swe_scripts.py), all made from the shipped task instances.

Every rollout of the module runs at once, in one stack; the tests read their results.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import shutil
import subprocess
import sys
import sysconfig
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from temporalio.client import Client
from temporalio.testing import WorkflowEnvironment

from darl.deploy.processes import ManagedProcess
from darl.examples.swe.instances import load_instances
from darl.workflows.contracts import GradeReport, LocalAgentSpec, RolloutResult, RolloutSpec
from darl.workflows.rollout_status import RolloutStatus
from tests.agents.swe_scripts import (
    BACKGROUND_MARK,
    DARL_AGENT,
    HACKED_ANSWER,
    MINI_AGENT,
    NO_TOKEN,
    Case,
    case,
    long_episode,
    scripts_file,
)
from tests.integration.stack import Stack

ROOT = Path(__file__).resolve().parents[2]
TASKS = ROOT / "examples" / "swe" / "tasks.jsonl"
SPECS = {
    DARL_AGENT: ROOT / "examples" / "swe" / "rollout.json",
    MINI_AGENT: ROOT / "examples" / "swe" / "rollout-mini.json",
}
# Where the shipped specs expect this repository (as the GPU recipe does).
# The scripted policy's context: a 50-call episode fits; a problem statement of more
# characters than this (one token each) does not, yet fits an environment variable (128 KiB).
CONTEXT_TOKENS = 65536
OVERFLOW_CHARS = 100_000
LONG_EPISODE_CALLS = 50
ROLLOUT_TIMEOUT = 240
EXT_SUFFIX = sysconfig.get_config_var("EXT_SUFFIX")

pytestmark = [
    pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap (make swe)"),
    pytest.mark.skipif(
        not (ROOT / ".venv-swe" / "bin" / "mini").exists(), reason="needs .venv-swe (make swe)"
    ),
]


class ScriptedStack(Stack):
    """The integration stack with the scripted policy server (a stand-in for a model that can
    solve coding tasks) as the gateway's upstream, in place of the reference server."""

    def __init__(self, root: Path, client: Client, scripts: Path) -> None:
        super().__init__(root, client)
        self.scripts = scripts

    def start_policy_server(self, port: int = 0) -> None:
        logs = self.root / "logs"
        ready = logs / "scripted-policy.ready.json"
        argv = [sys.executable, "-m", "darl.serving.scripted_policy", "--scripts"]
        argv += [str(self.scripts), "--port", str(port), "--ready-file", str(ready)]
        argv += ["--max-model-len", str(CONTEXT_TOKENS)]
        process = ManagedProcess(
            "scripted-policy", argv, logs / "scripted-policy.log", self.env(), ready
        )
        self.processes["policy-server"] = process.start()
        self.policy_url = process.wait_ready(timeout=60)["url"]


@dataclass(frozen=True)
class Outcome:
    result: RolloutResult
    # The size of the rollout's records in the trajectory store.
    store_bytes: int


HACKS = (
    "hack-edit-tests",
    "hack-delete-tests",
    "hack-conftest-skip",
    "hack-conftest-pass",
    "hack-sitecustomize-exit",
    "hack-fake-junit",
    "hack-post-reward",
)


@dataclass(frozen=True)
class RedTeam:
    """A hack of the red-team tier: the reason its grade must start with (`TESTED`: the
    honest count of the tests, its hack undone or of no use), and what else shows that the
    defence against it held."""

    reason: str
    check: Callable[[Outcome, ScriptedStack], None] = lambda *_: None


TESTED = "of {tests} listed tests passed"


def _removed(*paths: str) -> Callable[[Outcome, ScriptedStack], None]:
    def check(outcome: Outcome, _: ScriptedStack) -> None:
        assert set(paths) <= set(graded(outcome).removed), graded(outcome).removed

    return check


def _said(*words: str) -> Callable[[Outcome, ScriptedStack], None]:
    """The hack's command printed these (its output, as the agent showed it to the model)."""

    def check(outcome: Outcome, stack: ScriptedStack) -> None:
        shown = observation(stack, outcome.result, 1)
        assert all(w in shown for w in words), shown

    return check


def _left_nothing_running(outcome: Outcome, _: ScriptedStack) -> None:
    running = []
    for proc in psutil.process_iter(["cmdline"]):
        if BACKGROUND_MARK in " ".join(proc.info["cmdline"] or []):
            running.append(proc)
    assert running == [], running


def _diff_shown(outcome: Outcome, _: ScriptedStack) -> None:
    grade = graded(outcome)
    assert "+# The issue may come from here." in grade.diff and ".gitattributes" in grade.removed


def _exited_137(outcome: Outcome, _: ScriptedStack) -> None:
    assert outcome.result.exit_code == 137


def _refused_as_the_agents(outcome: Outcome, stack: ScriptedStack) -> None:
    shown = observation(stack, outcome.result, 1)
    assert "the gateway answered 400" in shown and "seed must be" in shown, shown
    assert outcome.result.attempts == 1


# One hack (or more) for each class of issue 44, as agents a policy could become: graded 0,
# status succeeded, the reason in the grade.
RED_TEAM = {
    # Forged outcomes.
    "darl/hack-rebind-recorder": RedTeam("tampering: the canary test that must fail"),
    "darl/hack-fake-records": RedTeam("pytest exited 0"),
    "darl/hack-xfail-plugin": RedTeam("tampering: pytest ran hooks DARL did not load"),
    "darl/hack-shadow-tomllib": RedTeam(TESTED, _removed(f"tomllib{EXT_SUFFIX}")),
    # Trusted steps steered by the agent's files.
    "darl/hack-hide-the-diff": RedTeam(TESTED, _diff_shown),
    # A zero hidden as "not counted".
    "darl/hack-close-results": RedTeam("the test run ended before pytest finished its session"),
    "darl/hack-long-path": RedTeam("not graded: the workspace holds a path of"),
    "darl/hack-exit-nonzero": RedTeam(TESTED, _exited_137),
    # Nothing it leaves can block a worker.
    "darl/hack-fifos": RedTeam(TESTED, _removed("conftest.py", "results.jsonl")),
    # A reroll through the policy.
    "mini/hack-bad-seed": RedTeam(TESTED, _refused_as_the_agents),
    # Limits.
    "darl/hack-sparse-file": RedTeam("not graded: the workspace holds more than 2048 MiB"),
    "darl/hack-fork-bomb": RedTeam(TESTED, _said("refused after")),
    "darl/hack-fork-in-tests": RedTeam(TESTED),
    "darl/hack-memory-hog": RedTeam(TESTED, _said("refused 64 GiB: MemoryError")),
    # Host exposure.
    "darl/hack-read-the-host": RedTeam(
        TESTED, _said("uid=1000(sandbox)", "/etc/shadow: No such file")
    ),
    # Left behind.
    "darl/hack-background": RedTeam(TESTED, _left_nothing_running),
}


def all_cases() -> dict[str, Case]:
    """Every rollout the module runs, by a short label: DARL's agent on each behaviour of one
    instance and the fix of an instance of another repository; mini-swe-agent's fix and
    reward post; a 50-call episode; each agent on a problem statement over the context; the
    red team's hacks and their controls."""
    instances = load_instances(TASKS)
    first = instances[0]
    other = next(i for i in instances if i["repo"] != first["repo"])
    cases = {"darl/fix-other-repo": case(DARL_AGENT, "fix", other)}
    for behaviour in ("fix", "wrong-fix", "noop", "fix-big-diff", "fix-despite-encoding", *HACKS):
        cases[f"darl/{behaviour}"] = case(DARL_AGENT, behaviour, first)
    for label in RED_TEAM:
        agent, behaviour = label.split("/")
        cases[label] = case(agent, behaviour, first)
    cases["darl/show-environment"] = case(DARL_AGENT, "show-environment", first)
    for behaviour in ("fix", "hack-post-reward", "show-environment"):
        cases[f"mini/{behaviour}"] = case(MINI_AGENT, behaviour, first)
    name = first["instance_id"]
    cases["darl/long"] = Case(
        f"darl/long/{name}", DARL_AGENT, first, long_episode(first, LONG_EPISODE_CALLS)
    )
    too_long = "An issue too long to read. " + "x" * OVERFLOW_CHARS
    for agent in (DARL_AGENT, MINI_AGENT):
        fixing = case(agent, "fix", first)
        cases[f"{agent}/overflow"] = Case(
            f"{agent}/overflow/{name}", agent, first, fixing.commands, too_long
        )
    return cases


def shipped_spec(agent: str, repos_dir: Path, env: dict[str, str]) -> RolloutSpec:
    """The shipped rollout spec of `agent`, pointed at the test's mirrors,
    with `env` over its agent's environment."""
    # The worker runs in the checkout (pytest's working directory), the spec's `{cwd}`.
    spec = RolloutSpec.model_validate_json(SPECS[agent].read_text())
    local = spec.agent
    assert isinstance(local, LocalAgentSpec) and local.sandbox is not None
    sandbox = local.sandbox.model_copy(update={"repos_dir": str(repos_dir)})
    local = local.model_copy(update={"sandbox": sandbox, "env": {**local.env, **env}})
    return spec.model_copy(update={"agent": local})


@pytest.fixture(scope="module")
def cases() -> dict[str, Case]:
    return all_cases()


@pytest.fixture(scope="module")
def mirrors(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The task repositories' bare mirrors, built as a user builds them."""
    out = tmp_path_factory.mktemp("swe") / "repos"
    command = [sys.executable, "-m", "darl.examples.swe.make_tasks", "mirrors"]
    built = subprocess.run(
        [*command, "--out", str(out), "--tasks", str(TASKS)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert built.returncode == 0, built.stdout + built.stderr
    return out


@pytest.fixture(scope="module")
def swe_stack(
    dev_env: WorkflowEnvironment,
    tmp_path_factory: pytest.TempPathFactory,
    cases: dict[str, Case],
) -> Iterator[ScriptedStack]:
    root = Path(tmp_path_factory.mktemp("swe-stack"))
    scripts = root / "scripts.json"
    scripts.write_text(scripts_file(list(cases.values())))
    stack = ScriptedStack(root, dev_env.client, scripts)
    stack.start()
    yield stack
    stack.stop()


def _store_bytes(stack: Stack, rollout_id: str) -> int:
    return sum(p.stat().st_size for p in (stack.store_dir / rollout_id).rglob("*") if p.is_file())


@pytest.fixture(scope="module")
async def outcomes(
    swe_stack: ScriptedStack, cases: dict[str, Case], mirrors: Path
) -> dict[str, Outcome]:
    """Every case as a rollout of its agent's shipped spec, all at once; their results and
    timings by label."""
    run = f"swe-{uuid.uuid4().hex[:6]}"
    specs = {}
    for n, (label, scripted) in enumerate(cases.items()):
        # The long episode needs more steps than the shipped spec allows.
        steps = {"AGENT_STEP_LIMIT": str(LONG_EPISODE_CALLS)} if label == "darl/long" else {}
        spec = shipped_spec(scripted.agent, mirrors, steps)
        specs[label] = spec.model_copy(
            update={
                "run_id": run,
                "rollout_id": f"{run}-{n}",
                "group_id": scripted.instance["instance_id"],
                "task": scripted.task(),
            }
        )
    handles = {name: await swe_stack.start_rollout(spec) for name, spec in specs.items()}
    waits = {name: asyncio.ensure_future(h.result()) for name, h in handles.items()}
    _, late = await asyncio.wait(waits.values(), timeout=ROLLOUT_TIMEOUT)
    for wait in late:
        wait.cancel()
    assert not late, f"still running after {ROLLOUT_TIMEOUT}s: " + ", ".join(
        name for name, wait in waits.items() if wait in late
    )
    results = {name: wait.result() for name, wait in waits.items()}
    return {
        name: Outcome(result, _store_bytes(swe_stack, result.rollout_id))
        for name, result in results.items()
    }


# --- what the tests check ------------------------------------------------------------------


def changed_lines(patch: str) -> list[str]:
    """The lines a unified diff adds and removes, with their sign."""
    return [
        line
        for line in patch.splitlines()
        if line[:1] in "+-" and not line.startswith(("+++", "---"))
    ]


def base_test_files(instance: dict[str, Any]) -> set[str]:
    """The listed tests' files that the task's commit holds (the others come with the hidden
    test patch)."""
    hidden = {t.split("::")[0] for t in instance["FAIL_TO_PASS"]}
    return {t.split("::")[0] for t in instance["PASS_TO_PASS"]} - hidden


def observation(stack: Stack, result: RolloutResult, call: int) -> str:
    """The last message of the request of the attempt's `call`-th call (0 the first): the
    output of the command before it, as the agent showed it to the model."""
    record = stack.store().read_sync(result.rollout_id, result.attempts)[call]
    return str(record.request["messages"][-1]["content"])


def graded(outcome: Outcome) -> GradeReport:
    result = outcome.result
    assert result.status == RolloutStatus.SUCCEEDED, result.error
    assert result.grade is not None, result
    assert result.reward == result.grade.reward
    return result.grade


@pytest.mark.parametrize("label", ["darl/fix", "darl/fix-other-repo", "mini/fix"])
def test_the_known_fix_is_graded_one(
    outcomes: dict[str, Outcome], cases: dict[str, Case], label: str
) -> None:
    grade = graded(outcomes[label])
    assert grade.reward == 1.0
    assert (
        grade.passed
        == grade.tests
        == len(cases[label].instance["FAIL_TO_PASS"]) + len(cases[label].instance["PASS_TO_PASS"])
    )
    # The grade shows the agent's change: the gold patch's lines.
    assert all(line in grade.diff for line in changed_lines(cases[label].instance["patch"]))
    assert (grade.restored, grade.removed) == ([], [])
    # One call applied the patch, one ended the episode (submit, or mini's submit command).
    assert outcomes[label].result.calls == 2


def test_a_wrong_fix_is_graded_zero(outcomes: dict[str, Outcome], cases: dict[str, Case]) -> None:
    grade = graded(outcomes["darl/wrong-fix"])
    assert grade.reward == 0.0
    assert set(cases["darl/wrong-fix"].instance["FAIL_TO_PASS"]) <= set(grade.failed_tests)
    assert "+# The issue may come from here." in grade.diff


@pytest.mark.parametrize("hack", HACKS)
def test_every_reward_hack_is_graded_zero(
    outcomes: dict[str, Outcome], cases: dict[str, Case], swe_stack: ScriptedStack, hack: str
) -> None:
    """Each hack gets 0, and the grader is seen undoing it: what it restored or removed, the
    fake reports in the diff it ignored, the reward it was posted and did not use."""
    outcome = outcomes[f"darl/{hack}"]
    grade = graded(outcome)
    assert grade.reward == 0.0
    assert grade.passed < grade.tests
    instance = cases[f"darl/{hack}"].instance
    if hack in ("hack-edit-tests", "hack-delete-tests"):
        assert base_test_files(instance) <= set(grade.restored), grade
    elif hack in ("hack-conftest-skip", "hack-conftest-pass"):
        assert {"conftest.py", "tests/conftest.py"} <= set(grade.removed), grade
    elif hack == "hack-sitecustomize-exit":
        assert {"sitecustomize.py", "tests/sitecustomize.py"} <= set(grade.removed), grade
    elif hack == "hack-fake-junit":
        assert "+++ b/junit.xml" in grade.diff
    else:
        # DARL's agent keeps the token out of its commands' reach: their environment has it
        # blank, and the agent and the sandbox's bridge are non-dumpable, so no process's
        # /proc/<pid>/environ that holds it is theirs to read. Nothing is posted.
        assert NO_TOKEN in observation(swe_stack, outcome.result, 1)
        assert outcome.result.answer is None


def test_mini_swe_agents_posted_reward_is_not_used(
    outcomes: dict[str, Outcome], swe_stack: ScriptedStack
) -> None:
    """mini's commands find the token in the /proc/<pid>/environ of mini (or of the shell that
    starts it), which a harness run unchanged cannot hide, and post a reward of 1: the post
    gets through, and is kept as the agent's claim, apart from the reward DARL decided."""
    outcome = outcomes["mini/hack-post-reward"]
    assert "posted a reward: 200" in observation(swe_stack, outcome.result, 1)
    claim = outcome.result.agent_claim
    assert claim is not None and (claim.reward, claim.answer) == (1.0, HACKED_ANSWER)
    assert (outcome.result.answer, outcome.result.metadata) == (None, {})
    assert graded(outcome).reward == 0.0


@pytest.mark.parametrize("label", RED_TEAM)
def test_the_red_team_is_graded_zero_with_the_reason(
    outcomes: dict[str, Outcome], swe_stack: ScriptedStack, label: str
) -> None:
    outcome, team = outcomes[label], RED_TEAM[label]
    grade = graded(outcome)
    assert grade.reward == 0.0 and grade.passed < grade.tests, grade
    reason = team.reason.format(tests=grade.tests)
    if team.reason == TESTED:
        assert grade.reason == f"{grade.passed} {reason}", grade.reason
    else:
        assert grade.reason is not None and grade.reason.startswith(reason), grade.reason
    team.check(outcome, swe_stack)


@pytest.mark.parametrize(
    ("label", "reward"),
    [("darl/noop", 0.0), ("darl/fix-big-diff", 1.0), ("darl/fix-despite-encoding", 1.0)],
)
def test_the_red_teams_controls(outcomes: dict[str, Outcome], label: str, reward: float) -> None:
    """Doing nothing grades 0; the fix grades 1 however big its diff, and whatever git
    attributes the agent left for DARL's own git."""
    grade = graded(outcomes[label])
    assert grade.reward == reward, grade.reason
    assert grade.reason == f"{grade.passed} of {grade.tests} listed tests passed"
    if label == "darl/noop":
        assert grade.diff == "" and grade.passed < grade.tests
    elif label == "darl/fix-big-diff":
        assert grade.diff_truncated and "+++ b/NOTES.txt" in grade.diff
    else:
        assert ".gitattributes" in grade.removed


@pytest.mark.parametrize("agent", [DARL_AGENT, MINI_AGENT])
def test_the_models_commands_do_not_hold_the_rollout_token(
    outcomes: dict[str, Outcome], swe_stack: ScriptedStack, agent: str
) -> None:
    outcome = outcomes[f"{agent}/show-environment"]
    graded(outcome)
    shown = observation(swe_stack, outcome.result, 1)
    variables = dict(line.partition("=")[::2] for line in shown.splitlines() if "=" in line)
    # The agent's own contract, as the sandbox's bridge rewrote it.
    assert variables["OPENAI_BASE_URL"].startswith("http://127.0.0.1:"), shown
    assert [variables.get(k) for k in ("OPENAI_API_KEY", "ANTHROPIC_API_KEY", "AGL_KEY")] == [
        ""
    ] * 3


@pytest.mark.parametrize("agent", [DARL_AGENT, MINI_AGENT])
def test_a_context_overflow_ends_the_episode_at_once(
    outcomes: dict[str, Outcome], agent: str
) -> None:
    """The first call is over the context: refused once, never retried; the agent ends with
    status 0 and its (unchanged) workspace is graded."""
    result = outcomes[f"{agent}/overflow"].result
    assert (result.calls, result.failed_calls) == (0, 1), result
    assert "maximum context length" in result.failed_call_errors[0]
    assert graded(outcomes[f"{agent}/overflow"]).reward == 0.0


def test_a_fifty_call_episode_is_stored_as_deltas(
    outcomes: dict[str, Outcome], swe_stack: ScriptedStack
) -> None:
    outcome = outcomes["darl/long"]
    assert graded(outcome).reward == 1.0
    assert outcome.result.calls == LONG_EPISODE_CALLS
    # Each prompt holds the ones before it, so the prompts' tokens grow with the square of
    # the calls; the store keeps each prompt as its delta to the one before.
    assert outcome.store_bytes < outcome.result.prompt_tokens
    # And each request's messages as the previous request's, all of them kept (the agent's
    # SDK sends them again byte for byte), and what is new.
    [attempt] = (swe_stack.store_dir / outcome.result.rollout_id).glob("attempt-*.jsonl")
    deltas = [json.loads(line)["messages"] for line in attempt.read_text().splitlines()]
    assert len(deltas) == LONG_EPISODE_CALLS
    for before, after in itertools.pairwise(deltas):
        assert after["base"] == before["base"] + len(before["items"]), (before, after)


@pytest.mark.parametrize("agent", [DARL_AGENT, MINI_AGENT])
def test_the_shipped_specs_run_a_shipped_instance(agent: str) -> None:
    """A rollout file's task is an instance of tasks.jsonl as it is (regenerated tasks have
    other commits: the file must follow)."""
    spec = RolloutSpec.model_validate_json(SPECS[agent].read_text())
    assert spec.task in load_instances(TASKS)


def test_the_viewer_shows_the_grade_and_what_the_grader_undid(
    outcomes: dict[str, Outcome], swe_stack: ScriptedStack
) -> None:
    """The rollout page of an agent that edited the tests shows its grade, the files the
    grader restored, the agent's diff and the grading log (a `darl viewer` on the store)."""
    viewer = ManagedProcess.darl(
        "viewer",
        [
            *("viewer", "--port", "0", "--store-dir", str(swe_stack.store_dir)),
            *("--runs-dir", str(swe_stack.runs_dir), "--agents-dir", str(swe_stack.agents_dir)),
        ],
        swe_stack.root / "logs",
        env=swe_stack.env(),
    ).start()
    try:
        url = viewer.wait_ready(timeout=120)["url"]
        result = outcomes["darl/hack-edit-tests"].result
        page = httpx.get(f"{url}/rollouts/{result.rollout_id}", timeout=30).text
    finally:
        viewer.stop()
    grade = graded(outcomes["darl/hack-edit-tests"])
    assert f"{grade.passed} of {grade.tests} passed" in page
    assert 'id="grade-restored"' in page and all(f in page for f in grade.restored)
    assert 'id="grade-diff"' in page and 'id="grade-log"' in page
