"""Rollouts of real agents through the real gateway and policy server on the Temporal dev
server: everything completes, every call the policy server answered is captured once, and the
store holds exactly the token ids the policy server returned."""

from __future__ import annotations

import asyncio
import json
import subprocess
import uuid
from pathlib import Path

from temporalio.client import WorkflowHandle

from darl.workflows.contracts import (
    LocalAgentSpec,
    RewardSpec,
    RolloutResult,
    RolloutSpec,
    RolloutTimeouts,
)
from darl.workflows.names import ROLLOUT_WORKFLOW
from darl.workflows.rollout_status import RolloutStatus
from tests.conftest import BIN
from tests.integration.stack import Stack

ROOT = Path(__file__).resolve().parents[2]
RESULT_TIMEOUT = 240


def example_spec(agent_module: str, index: int, env: dict[str, str] | None = None) -> RolloutSpec:
    return RolloutSpec(
        run_id="e2e",
        rollout_id=f"e2e-{uuid.uuid4().hex[:8]}-{index}",
        group_id=f"g{index % 5}",
        task={"question": f"What is {index} + 2?", "answer": str(index + 2)},
        agent=LocalAgentSpec(command=["{python}", "-m", agent_module], env=env or {}),
        reward=RewardSpec(function="numeric_match"),
        timeouts=RolloutTimeouts(agent_seconds=180, heartbeat_seconds=10),
    )


async def results(handles: list[WorkflowHandle]) -> list[RolloutResult]:
    # One at a time: awaiting many results at once is fine on the dev server, but keeps the
    # failure message of the first broken rollout readable.
    return [await asyncio.wait_for(h.result(), RESULT_TIMEOUT) for h in handles]


async def test_twenty_example_rollouts_are_captured_exactly(stack: Stack) -> None:
    answered_before = len(stack.policy_responses())
    specs = [example_spec("darl.examples.arithmetic.agent", i) for i in range(10)] + [
        example_spec(
            "darl.examples.arithmetic.calculator_agent", i, {"AGENT_STREAM": "1" if i % 2 else "0"}
        )
        for i in range(10, 20)
    ]
    done = await results([await stack.start_rollout(s) for s in specs])

    assert [r.status for r in done] == [RolloutStatus.SUCCEEDED] * 20, [r.error for r in done]
    assert all(r.reward in (0.0, 1.0) for r in done)
    assert [r.calls for r in done] == [1] * 10 + [2] * 10
    answered = stack.policy_responses()[answered_before:]
    assert len(answered) == sum(r.calls for r in done) == 30

    by_response_id = {line["id"]: line for line in answered}
    store = stack.store()
    for result in done:
        records = store.read_sync(result.rollout_id, call_ids=result.call_ids)
        assert [r.call_id for r in records] == result.call_ids
        for record in records:
            served = by_response_id[record.response["id"].split("-", 1)[1]]
            assert record.prompt_token_ids == served["prompt_token_ids"]
            assert record.completion_token_ids() == served["token_ids"][0]
            logprobs = record.completion_logprobs()
            assert logprobs is not None and len(logprobs) == len(served["token_ids"][0])
    streamed = [r for r in done[10:] if store.read_sync(r.rollout_id)[0].streamed]
    assert len(streamed) == 5


async def test_agent_lightning_agents_run_unchanged(stack: Stack) -> None:
    spec = RolloutSpec(
        run_id="agl",
        rollout_id=f"agl-{uuid.uuid4().hex[:8]}",
        task={"question": "What is 1 + 1?"},
        agent=LocalAgentSpec(
            entrypoint="tests.agents.agl_agent:AglStyleAgent",
            env_map={"QUESTION": "input.question"},
            cwd=str(ROOT),
        ),
    )
    result = await asyncio.wait_for((await stack.start_rollout(spec)).result(), RESULT_TIMEOUT)
    assert result.status == RolloutStatus.SUCCEEDED, result.error
    assert result.reward == 0.25
    assert result.calls == 1


def test_the_documented_rollout_starts_with_the_temporal_cli(stack: Stack) -> None:
    """`temporal workflow start --type RolloutWorkflow --input-file examples/...` as the README
    and docs/getting-started.md show it (with the test's own task queue)."""
    rollout_id = f"cli-{uuid.uuid4().hex[:8]}"
    text = (ROOT / "examples/arithmetic/rollout.json").read_text()
    spec_file = stack.root / "rollout.json"
    spec_file.write_text(text.replace('"hello-0"', f'"{rollout_id}"'))
    completed = subprocess.run(
        [
            str(BIN / "temporal"),
            "workflow",
            "execute",
            "--type",
            ROLLOUT_WORKFLOW,
            "--task-queue",
            stack.task_queue,
            "--workflow-id",
            f"rollout/{rollout_id}",
            "--input-file",
            str(spec_file),
            "--address",
            stack.env()["TEMPORAL_ADDRESS"],
            "--output",
            "json",
        ],
        capture_output=True,
        text=True,
        timeout=RESULT_TIMEOUT,
        cwd=ROOT,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr + completed.stdout
    result = json.loads(completed.stdout)["result"]
    assert result["status"] == "succeeded", result
    assert result["rollout_id"] == rollout_id
    assert result["calls"] == 1
