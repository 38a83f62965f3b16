"""The relay example (examples/relay): its agent sends the conversation whole, token ids in and
out, to a real policy server with the digits model; its reward counts every call; its shipped
tasks and training config are the ones its code makes and names."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from darl.deploy.config_file import load_config
from darl.examples.digits.task import TaskSpecError
from darl.examples.relay import task as relay
from darl.examples.relay.agent_service import RelayAgent, create_service_app
from darl.serving.policy_app import create_policy_app
from darl.serving.policy_server import PolicyServer
from darl.serving.tiny_model import MODEL_PRESETS, create_model_dir
from darl.trainer.datasets import load_tasks
from tests.serving import served

EXAMPLE = Path(relay.__file__).parent
TASK = {"id": "t", "prompt": "4=", "answer": "4", "calls": 3, "max_tokens": 3}


@pytest.fixture
async def policy_url(tmp_path: Path) -> AsyncIterator[str]:
    """A real policy server with the digits model, logging what it generated."""
    model_dir = create_model_dir(tmp_path / "digits", MODEL_PRESETS["digits"])
    server = PolicyServer(model_dir, max_batch=8, response_log=tmp_path / "responses.jsonl")
    server.engine.start()
    try:
        async with served(create_policy_app(server), tmp_path, "policy") as url:
            yield f"{url}/v1"
    finally:
        await asyncio.to_thread(server.engine.stop)


async def rollout(base_url: str, task: object) -> httpx.Response:
    transport = httpx.ASGITransport(app=create_service_app(RelayAgent()))
    async with httpx.AsyncClient(transport=transport, base_url="http://agent") as client:
        body = {
            "rollout_id": "r1",
            "attempt": 1,
            "task": task,
            "openai_base_url": base_url,
            "api_key": "token",
        }
        return await client.post("/rollouts", json=body, timeout=60)


async def test_each_call_sends_the_conversation_so_far_with_the_last_answer(
    policy_url: str, tmp_path: Path
) -> None:
    response = await rollout(policy_url, TASK)
    assert response.status_code == 200, response.text
    texts = json.loads(response.json()["answer"])
    assert len(texts) == 3
    calls = [json.loads(line) for line in (tmp_path / "responses.jsonl").read_text().splitlines()]
    assert len(calls) == 3
    separator = calls[0]["prompt_token_ids"][-1]
    for before, after in itertools.pairwise(calls):
        # The previous prompt, the previous answer's ids and the separator: one growing row.
        assert after["prompt_token_ids"] == [
            *before["prompt_token_ids"],
            *before["token_ids"][0],
            separator,
        ]


async def test_a_task_without_a_prompt_is_refused(policy_url: str) -> None:
    assert (await rollout(policy_url, {"id": "t", "calls": 3})).status_code == 422


def test_the_reward_is_the_mean_of_the_calls_digit_rewards() -> None:
    assert relay.relay_reward(TASK, json.dumps(["4", "4", "4"])) == 1.0
    assert relay.success(TASK, json.dumps(["4", "4", "4"]))
    # A wrong digit that stopped right: half of its call; a call never made: nothing.
    assert relay.relay_reward(TASK, json.dumps(["4", "7"])) == pytest.approx((1 + 0.5) / 3)
    assert not relay.success(TASK, json.dumps(["4", "7"]))
    assert relay.relay_reward(TASK, "not json") == relay.relay_reward(TASK, None) == 0.0


def test_bad_task_parameters_are_refused() -> None:
    with pytest.raises(TaskSpecError):
        relay.make_tasks(3, seed=0, calls=1)


def test_the_shipped_tasks_and_config_are_the_examples_own() -> None:
    assert load_tasks(EXAMPLE / "tasks.jsonl").rows == relay.make_tasks(20, seed=7)
    assert load_tasks(EXAMPLE / "validation.jsonl").rows == relay.make_tasks(100, seed=8)
    config = load_config(EXAMPLE / "train.yaml", "relay-test")
    assert config.rollout.reward.function == "darl.examples.relay.task:relay_reward"
    assert config.backend.model_dir.endswith("models/digits")
    assert config.validation.path is not None
    assert Path(config.validation.path).name == "validation.jsonl"
