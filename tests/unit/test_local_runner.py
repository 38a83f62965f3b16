"""The local process runner with real processes: idempotent launch, the agent contract in the
environment (and no secrets), re-attach from the handle alone, stop before and after launch,
and the crash window where an agent finished before its handle was saved."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from temporalio.exceptions import ApplicationError

from darl.activities.agent_contract import ContractIssuer, TaskValueTooLargeError
from darl.activities.runners import local
from darl.activities.runners.local import (
    EXIT_FILE,
    HANDLE_FILE,
    LAUNCH_MARKER,
    LocalProcessRunner,
    stop_leftover_agents,
)
from darl.workflows.contracts import (
    AwaitRequest,
    LaunchRequest,
    LocalAgentSpec,
    RolloutSpec,
    RolloutTimeouts,
)

ISSUER = ContractIssuer("http://gateway.test", b"secret")


@pytest.fixture(autouse=True)
def no_agent_left_behind(tmp_path: Path) -> Iterator[None]:
    yield
    stop_leftover_agents(tmp_path, grace_seconds=1)


def launch_request(
    command: list[str], rollout_id: str = "r1", task: dict | None = None
) -> LaunchRequest:
    spec = RolloutSpec(
        run_id="run",
        rollout_id=rollout_id,
        task=task or {"q": "2+2", "n": 3},
        agent=LocalAgentSpec(command=command, env_map={"N": "input.n"}),
        timeouts=RolloutTimeouts(agent_seconds=30, heartbeat_seconds=1),
    )
    return LaunchRequest(spec=spec, attempt=1)


async def run_to_end(runner: LocalProcessRunner, request: LaunchRequest, handle) -> int | None:
    contract = ISSUER.issue(request.spec, 1, None, request.spec.agent.env_map)
    beats: list[object] = []
    result = await runner.wait(
        AwaitRequest(spec=request.spec, attempt=1, handle=handle), contract, beats.append
    )
    return result.exit_code


def agent_group_leaders(attempt_dir: Path) -> list[int]:
    """Process groups started for this attempt (each agent leads one)."""
    leaders = []
    for proc in psutil.process_iter(["pid"]):
        try:
            key = proc.environ().get("DARL_AGENT_KEY")
            if key == str(attempt_dir) and os.getpgid(proc.pid) == proc.pid:
                leaders.append(proc.pid)
        except (psutil.Error, ProcessLookupError):
            continue
    return leaders


def contract_for(request: LaunchRequest):
    return ISSUER.issue(request.spec, 1, None, request.spec.agent.env_map)


async def test_the_agent_gets_the_contract_and_no_secrets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DARL_ADMIN_KEY", "never-for-agents")
    monkeypatch.setenv("DARL_TOKEN_SECRET", "never-for-agents")
    runner = LocalProcessRunner(tmp_path)
    request = launch_request(["sh", "-c", "env; echo out; echo err >&2"])
    handle = await runner.launch(request, contract_for(request))
    assert await run_to_end(runner, request, handle) == 0
    log = (tmp_path / "r1" / "attempt-1" / "agent.log").read_text()
    env = dict(line.split("=", 1) for line in log.splitlines() if "=" in line)
    assert env["OPENAI_BASE_URL"] == "http://gateway.test/rollouts/r1/v1"
    assert env["OPENAI_API_KEY"] == env["AGL_KEY"]
    assert env["DARL_RESULT_URL"] == "http://gateway.test/rollouts/r1/result"
    assert env["AGL_EVENT_URL"] == "http://gateway.test/api/rollouts/r1/attempt/1/events"
    assert json.loads(env["DARL_TASK"]) == request.spec.task
    assert env["N"] == "3"  # env_map, JSON-encoded when not a string
    assert "DARL_ADMIN_KEY" not in env and "DARL_TOKEN_SECRET" not in env
    assert "out" in log and "err" in log


# A SWE-bench-sized row: over what Linux takes in one environment string (128 KiB).
LARGE_TASK = {"q": "2+2", "n": 3, "tests": [f"tests/test_x.py::test_{i}" for i in range(8000)]}
READS_ITS_TASK = """
import json, os
task = json.load(open(os.environ["DARL_TASK_FILE"]))
print("DARL_TASK" in os.environ, len(task["tests"]), os.environ["N"])
"""


async def test_a_task_too_large_for_the_environment_is_in_the_task_file(
    tmp_path: Path,
) -> None:
    """A task whose JSON is over TASK_ENV_MAX_BYTES starts its agent (in DARL_TASK it would
    make the start fail with "Argument list too long"): the task is in DARL_TASK_FILE, whole,
    and DARL_TASK is not set."""
    assert len(json.dumps(LARGE_TASK)) > 128 * 1024
    runner = LocalProcessRunner(tmp_path)
    request = launch_request([sys.executable, "-c", READS_ITS_TASK], task=LARGE_TASK)
    handle = await runner.launch(request, contract_for(request))
    assert await run_to_end(runner, request, handle) == 0
    log = (tmp_path / "r1" / "attempt-1" / "agent.log").read_text()
    assert log.split() == ["False", "8000", "3"], log


def test_an_env_map_value_too_large_for_the_environment_is_refused() -> None:
    """An `env_map` value has no file to go to: one over what Linux takes is refused, naming
    the variable and the field, before any agent starts."""
    request = launch_request(["true"], task=LARGE_TASK)
    big = {"TESTS": "input.tests"}
    refused = re.escape("env_map TESTS: the task's 'input.tests' is")
    with pytest.raises(TaskValueTooLargeError, match=refused):
        ISSUER.issue(request.spec, 1, None, big)
    small = ISSUER.issue(request.spec, 1, None, {"N": "input.n"})
    assert "DARL_TASK" not in small.env and small.env["N"] == "3"


async def test_a_second_launch_returns_the_first_agent(tmp_path: Path) -> None:
    runner = LocalProcessRunner(tmp_path)
    request = launch_request(["sleep", "30"])
    first = await runner.launch(request, contract_for(request))
    again = await LocalProcessRunner(tmp_path).launch(request, contract_for(request))
    assert again == first
    assert agent_group_leaders(tmp_path / "r1" / "attempt-1") == [first.data["pid"]]
    await runner.kill(first)
    assert not psutil.pid_exists(first.data["pid"]) or (
        psutil.Process(first.data["pid"]).status() == psutil.STATUS_ZOMBIE
    )


async def test_another_runner_reattaches_and_reads_the_exit_code(tmp_path: Path) -> None:
    request = launch_request(["sh", "-c", "sleep 0.5; exit 7"])
    handle = await LocalProcessRunner(tmp_path).launch(request, contract_for(request))
    # A fresh runner (a new worker) knows the agent only through its handle.
    assert (
        await asyncio.wait_for(run_to_end(LocalProcessRunner(tmp_path), request, handle), 10) == 7
    )


async def test_an_agent_killed_from_outside_is_lost(tmp_path: Path) -> None:
    runner = LocalProcessRunner(tmp_path)
    request = launch_request(["sleep", "30"])
    handle = await runner.launch(request, contract_for(request))
    os.killpg(handle.data["pid"], 9)
    with pytest.raises(ApplicationError) as lost:
        await asyncio.wait_for(run_to_end(runner, request, handle), 10)
    assert lost.value.type == "AgentLostError"


async def test_a_stopped_attempt_is_killed_and_never_launched_again(tmp_path: Path) -> None:
    runner = LocalProcessRunner(tmp_path)
    request = launch_request(["sleep", "30"])
    handle = await runner.launch(request, contract_for(request))
    await runner.stop(request)
    assert not psutil.pid_exists(handle.data["pid"]) or (
        psutil.Process(handle.data["pid"]).status() == psutil.STATUS_ZOMBIE
    )
    other = launch_request(["sleep", "30"], rollout_id="r2")
    await runner.stop(other)  # before its launch: the launch that comes later is refused
    with pytest.raises(ApplicationError) as refused:
        await runner.launch(other, contract_for(other))
    assert refused.value.type == "AgentStopped"
    assert not (tmp_path / "r2" / "attempt-1" / HANDLE_FILE).exists()


async def test_an_agent_that_finished_before_its_handle_was_saved(tmp_path: Path) -> None:
    """The worker died between starting the agent and saving the handle, and the agent has
    finished since: the retried launch adopts the result instead of starting a second agent."""
    attempt_dir = tmp_path / "r1" / "attempt-1"
    attempt_dir.mkdir(parents=True)
    (attempt_dir / LAUNCH_MARKER).touch()
    (attempt_dir / EXIT_FILE).write_text("3")
    runner = LocalProcessRunner(tmp_path)
    request = launch_request(["sh", "-c", "echo second agent > second.txt"])
    handle = await runner.launch(request, contract_for(request))
    assert handle.data["pid"] is None
    assert await run_to_end(runner, request, handle) == 3
    assert stop_leftover_agents(tmp_path) == 0


async def test_stop_leftover_agents_kills_what_still_runs(tmp_path: Path) -> None:
    runner = LocalProcessRunner(tmp_path)
    handles = [
        await runner.launch(r, contract_for(r))
        for r in (launch_request(["sleep", "30"], f"left-{i}") for i in range(3))
    ]
    assert stop_leftover_agents(tmp_path, grace_seconds=2) == 3
    for handle in handles:
        pid = handle.data["pid"]
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    await runner.aclose()


def test_an_agent_stays_ours_across_a_wall_clock_step() -> None:
    """psutil's create_time is the boot time (which the kernel derives from the wall clock)
    plus the start in ticks: a clock step moves both it and the boot time. The handle keeps
    the boot time it read, so the agent is compared by its start since boot."""
    proc = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        create_time = psutil.Process(proc.pid).create_time()
        boot_time = psutil.boot_time()
        # The wall clock as it read at launch, 2 s off what it reads now.
        assert local._is_our_leader(proc.pid, create_time + 2, boot_time + 2)
        assert not local._is_our_leader(proc.pid, create_time + 2)  # a handle without it
        assert not local._is_our_leader(proc.pid, create_time + 2, boot_time)  # another start
    finally:
        proc.kill()
        proc.wait()


def test_an_agent_without_isolation_cannot_freeze_the_runner_with_its_files(
    tmp_path: Path,
) -> None:
    """Without a sandbox the agent can reach its attempt's directory: a FIFO where its exit
    status or log goes, or a link there, is read as what it is, at once (an open that waited
    for a writer would hold the worker's event loop, and every rollout on it)."""
    attempt = tmp_path / "attempt"
    attempt.mkdir()
    os.mkfifo(attempt / EXIT_FILE)
    os.mkfifo(attempt / local.LOG_FILE)
    # An open that waited would hang here until the test's own timeout failed it.
    assert local._read_exit_code(attempt / EXIT_FILE) == 1
    assert local._log_tail(attempt) == ""
    (attempt / EXIT_FILE).unlink()
    (attempt / "elsewhere").write_text("0")
    (attempt / EXIT_FILE).symlink_to(attempt / "elsewhere")
    assert local._read_exit_code(attempt / EXIT_FILE) == 1
    (attempt / EXIT_FILE).unlink()
    (attempt / EXIT_FILE).write_text("3")
    assert local._read_exit_code(attempt / EXIT_FILE) == 3
