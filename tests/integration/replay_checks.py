"""Running a replay scenario on a test stack (rule 10): a multi-turn agent killed from outside
at a known call, and the checks every resumed rollout must pass, read from outside the
workflow: the store's records of both attempts, the policy server's own log of what it
generated, and the training rows the trainer makes of the trajectory."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from temporalio.client import WorkflowHandle

from darl.gateway.store.record import CallRecord
from darl.trainer.aggregation import (
    AggregationCounters,
    AggregationSettings,
    RolloutSample,
    rollout_rows,
)
from darl.workflows.contracts import (
    AgentSpec,
    LocalAgentSpec,
    RolloutResult,
    RolloutSpec,
    RolloutTimeouts,
)
from tests.integration.stack import Stack

REPLAY_AGENT = str(Path(__file__).resolve().parents[1] / "agents" / "replay_agent.py")
TIMEOUT = 120


@dataclass
class Scenario:
    """One rollout of the replay agent, killed after `kill_after` answers of attempt 1."""

    name: str
    kill_after: int
    turns: int = 10
    settings: dict[str, str] = field(default_factory=dict)
    spec_overrides: dict[str, Any] = field(default_factory=dict)


def replay_settings(stack: Stack, scenario: Scenario) -> dict[str, str]:
    marker_dir = stack.root / "replay-markers"
    marker_dir.mkdir(exist_ok=True)
    return {
        "TURNS": str(scenario.turns),
        "KILL_AFTER": str(scenario.kill_after),
        "AGENT_LOG": str(stack.root / "replay-agent.log"),
        "MARKER_DIR": str(marker_dir),
        **scenario.settings,
    }


def local_spec(stack: Stack, scenario: Scenario, agent: AgentSpec | None = None) -> RolloutSpec:
    rollout_id = f"replay-{scenario.name}-{uuid.uuid4().hex[:8]}"
    values: dict[str, Any] = {
        "run_id": "replay",
        "rollout_id": rollout_id,
        # Its own question: no other rollout's call has the prompt of one of its calls.
        "task": {"question": f"Rollout {rollout_id}: count the letters of your answers."},
        "agent": agent
        or LocalAgentSpec(command=["{python}", REPLAY_AGENT], env=replay_settings(stack, scenario)),
        "timeouts": RolloutTimeouts(
            agent_seconds=TIMEOUT, heartbeat_seconds=2, retry_backoff_seconds=0.1
        ),
        "revision": 3,
        **scenario.spec_overrides,
    }
    return RolloutSpec(**values)


async def wait_for_marker(stack: Stack, rollout_id: str, attempt: int = 1) -> None:
    """Until the agent of `attempt` has its answers and waits to be killed."""
    marker = stack.root / "replay-markers" / f"{rollout_id}.{attempt}"
    async with asyncio.timeout(TIMEOUT):
        while not marker.exists():
            await asyncio.sleep(0.05)


def sigkill_local_agent(stack: Stack, rollout_id: str, attempt: int = 1) -> None:
    """SIGKILL the attempt's whole process group, as a lost machine would end it."""
    handle = json.loads(
        (stack.agents_dir / rollout_id / f"attempt-{attempt}" / "handle.json").read_text()
    )
    os.killpg(int(handle["data"]["pid"]), signal.SIGKILL)


async def run_killed(
    stack: Stack, spec: RolloutSpec, kill: Callable[[], Awaitable[None] | None]
) -> RolloutResult:
    """Start the rollout, kill its agent at the marker, and return its result."""
    handle: WorkflowHandle[Any, RolloutResult] = await stack.start_rollout(spec)
    await wait_for_marker(stack, spec.rollout_id)
    killed = kill()
    if killed is not None:
        await killed
    return await asyncio.wait_for(handle.result(), TIMEOUT)


def agent_log(stack: Stack, rollout_id: str) -> list[dict[str, Any]]:
    path = stack.root / "replay-agent.log"
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    return [line for line in lines if line["rollout"] == rollout_id and "call_id" in line]


def trajectory_rows(
    records: list[CallRecord], mode: str = "trajectory"
) -> tuple[list[Any], AggregationCounters]:
    counters = AggregationCounters()
    settings = AggregationSettings(
        mode=mode, max_prompt_length=100_000, max_response_length=100_000
    )
    sample = RolloutSample(rollout_id="r", group_id="g", reward=1.0, records=records)
    return rollout_rows(sample, settings, counters), counters


def check_resumed(
    stack: Stack, result: RolloutResult, kill_after: int, ordered: bool = True
) -> list[CallRecord]:
    """The checks every rollout resumed by replay passes; returns its final trajectory.
    `ordered`: the agent sends one call at a time (else concurrent calls may be recorded in
    another order than the first run's)."""
    assert result.status == "succeeded", result.error
    assert result.attempts == 2, result
    store = stack.store()
    first = store.read_sync(result.rollout_id, 1)
    final = store.read_sync(result.rollout_id, call_ids=result.call_ids)
    assert len(first) == kill_after
    assert all(r.attempt == 2 for r in final)
    assert result.replayed_calls == kill_after, result
    assert result.replay_diverged_at is None
    recorded = {r.call_id: r for r in first}
    replayed = [r for r in final if r.replayed_from is not None]
    live = [r for r in final if r.replayed_from is None]
    # Each of attempt 1's calls reproduced once: its answer, tokens, logprobs and version.
    assert sorted(r.replayed_from or "" for r in replayed) == sorted(recorded)
    for again in replayed:
        original = recorded[again.replayed_from or ""]
        assert again.response == original.response
        assert again.prompt_token_ids == original.prompt_token_ids
        assert again.completion_logprobs() == original.completion_logprobs()
        assert again.policy_version == original.policy_version
        assert not again.replay_normalized
    # ... before any call went live.
    assert final[:kill_after] == replayed and live
    if ordered:
        assert [r.replayed_from for r in replayed] == [r.call_id for r in first]
    # The policy server's own log: none of the first k prompts was generated again.
    generated = [tuple(line["prompt_token_ids"]) for line in stack.policy_responses()]
    for original in first:
        assert generated.count(tuple(original.prompt_token_ids)) == 1
    served = {line["call_id"] for line in stack.policy_responses()}
    assert not served & {r.call_id for r in replayed}
    # The agent got the recorded answers, marked as replayed.
    again_log = [line for line in agent_log(stack, result.rollout_id) if line["attempt"] == 2]
    assert sorted(line["call_id"] for line in again_log) == sorted(r.call_id for r in final)
    marked = {line["call_id"]: line["replayed_from"] for line in again_log}
    assert all(marked[r.call_id] == r.replayed_from for r in final)
    # Trained as if never interrupted: the rows of the first run's calls plus the live ones.
    rows, _ = trajectory_rows(final)
    uninterrupted, _ = trajectory_rows(
        [recorded[r.replayed_from] if r.replayed_from else r for r in final]
    )
    assert rows == uninterrupted
    return final
