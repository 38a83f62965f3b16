"""A training run at real sizes on the real dev server: SWE-shaped rows of ~210 KB, a local
agent that reads them from its task file and tries to report a ~1 MB answer before reporting
within its budget, continue-as-new inside the run, and every step trained, with the trainer's
history far below Temporal's limits (issue 45: the run had wedged at step 0 on a 6.8 MB
start_rollouts input, and a history of 51 MB ended it after 64 rollouts)."""

from __future__ import annotations

import json
import random
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest
from google.protobuf.message import Message

from darl.workflows.contracts import LocalAgentSpec, RolloutTimeouts
from darl.workflows.training_config import RolloutSettings
from tests.agents.heavy_agent import fingerprint
from tests.integration.stack import Stack
from tests.integration.training_stack import (
    check_finished_run,
    start_training,
    training_config,
    training_result,
)

pytestmark = pytest.mark.integration

HEAVY_AGENT = str(Path(__file__).resolve().parents[1] / "agents" / "heavy_agent.py")
# What Temporal refuses: one payload over 2 MB, a history over 50 MB.
PAYLOAD_LIMIT = 2 * 1024 * 1024


def swe_row(i: int, rng: random.Random) -> dict:
    digit = str(rng.randrange(10))
    row = {
        "instance_id": f"repo__project-{i}",
        "prompt": f"{digit}=",
        "answer": digit,
        "max_tokens": 4,
        "PASS_TO_PASS": [
            f"tests/integration/test_module_{i}.py::TestTheProjectsBehaviour::test_case_{k:04d}"
            for k in range(2000)
        ],
        "patch": "".join(rng.choice("abcdef\n") for _ in range(20_000)),
        "test_patch": "".join(rng.choice("ghijkl\n") for _ in range(30_000)),
    }
    return {**row, "fingerprint": fingerprint(row)}


async def test_a_run_with_real_size_rows_and_reports_trains_every_step(training_stack: Stack):
    stack = training_stack
    run_id = f"sized-{uuid.uuid4().hex[:8]}"
    rng = random.Random(7)
    rows = [swe_row(i, rng) for i in range(24)]
    dataset = stack.root / "swe-shaped.jsonl"
    dataset.write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert min(len(json.dumps(row)) for row in rows) > 200_000
    config = training_config(
        stack,
        run_id,
        4,
        mode="async",
        group_size=4,
        batch_size=2,
        min_group_size=2,
        equal_reward_groups="train",
        continue_as_new_after_events=100,
        knobs={"max_inflight": 16, "max_staleness": 4},
        epochs=4,
    )
    agent = LocalAgentSpec(command=["{python}", HEAVY_AGENT])
    config = config.model_copy(
        update={
            "dataset": config.dataset.model_copy(update={"path": str(dataset)}),
            "rollout": RolloutSettings(
                agent=agent,
                reward=config.rollout.reward,
                timeouts=RolloutTimeouts(agent_seconds=60, heartbeat_seconds=5),
                task_queue=config.rollout.task_queue,
            ),
        }
    )
    handle = await start_training(stack.client, config, stack.trainer_queue)
    summary = await training_result(stack, handle, 420)
    check_finished_run(summary, config)
    assert summary.counters.rollouts_failed == 0, summary.counters
    assert summary.steps == 4

    # Continue-as-new happened, and no run of the chain came near a limit.
    runs, largest, total = 0, 0, 0
    run_id_now: str | None = (await handle.describe()).run_id
    while run_id_now is not None:
        runs += 1
        history = await stack.client.get_workflow_handle(
            handle.id, run_id=run_id_now
        ).fetch_history()
        sizes = [payload.ByteSize() for event in history.events for payload in _payloads(event)]
        largest = max([largest, *sizes])
        total = max(total, sum(event.ByteSize() for event in history.events))
        first = history.events[0].workflow_execution_started_event_attributes
        run_id_now = first.continued_execution_run_id or None
    print(f"{runs} runs; largest payload {largest:,} bytes; largest history {total:,} bytes")
    assert runs >= 2, "the run never continued as new"
    assert largest < PAYLOAD_LIMIT // 4, f"largest payload {largest:,} bytes"
    assert total < 5 * 1024 * 1024, f"a history of {total:,} bytes"


def _payloads(message: Message) -> Iterator[Message]:
    """Every payload a history event carries (inputs, results, signals, markers, headers)."""
    for field, value in message.ListFields():
        if field.message_type is None:
            continue
        if isinstance(value, Message):
            items: Iterable[Message] = [value]
        elif field.message_type.GetOptions().map_entry:
            items = value.values()
        else:
            items = value
        for item in items:
            if not isinstance(item, Message):
                continue  # a map of scalars
            if item.DESCRIPTOR.name == "Payload":
                yield item
            else:
                yield from _payloads(item)
