"""The agent contract as Agent Lightning v1.0 defines it: `env_map` values (the task, a path
in it, or a literal), tasks that are any JSON value, and the variables every attempt gets."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from darl.activities.agent_contract import (
    ContractIssuer,
    TaskPathError,
    env_map_values,
    task_field,
)
from darl.activities.run_checks import rows_missing
from darl.workflows.contracts import LocalAgentSpec, RolloutSpec

ISSUER = ContractIssuer("http://gateway.test", b"secret")
TASK = {"question": "What is 2 + 2?", "items": [{"n": 1}, {"n": 2}], "meta": {"level": 3}}


def rollout(task: object, env_map: dict[str, str] | None = None) -> RolloutSpec:
    return RolloutSpec(
        run_id="run",
        rollout_id="r1",
        task=task,
        agent=LocalAgentSpec(command=["true"], env_map=env_map or {}),
    )


def test_env_map_values_are_task_paths_or_literals_as_in_agent_lightning() -> None:
    env_map = {
        # Agent Lightning's gsm8k and search_r1 configs set the model name this way.
        "MODEL": "Qwen/Qwen2.5-1.5B",
        "QUESTION": "input.question",
        "FIRST": "input.items.0",
        "SECOND_N": "input.items.1.n",
        "LEVEL": "input.meta.level",
        "TASK": "input",
        "PLAIN": "question",  # no `input.` prefix: a literal, as Agent Lightning reads it
        "EMPTY": "",
    }
    assert env_map_values(TASK, env_map) == {
        "MODEL": "Qwen/Qwen2.5-1.5B",
        "QUESTION": "What is 2 + 2?",
        "FIRST": '{"n": 1}',
        "SECOND_N": "2",
        "LEVEL": "3",
        "TASK": json.dumps(TASK),
        "PLAIN": "question",
        "EMPTY": "",
    }


@pytest.mark.parametrize(
    "path", ["input.answer", "input.items.2", "input.items.x", "input.question.0"]
)
def test_a_task_path_the_task_lacks_is_an_error_naming_it(path: str) -> None:
    with pytest.raises(TaskPathError, match=f"task has no field '{path}'"):
        env_map_values(TASK, {"X": path})


@pytest.mark.parametrize(
    ("task", "expected"),
    [("What is 2 + 2?", "What is 2 + 2?"), (7, "7"), ([1, "a"], '[1, "a"]'), (True, "true")],
)
def test_a_task_may_be_any_json_value(task: object, expected: str) -> None:
    spec = rollout(task, {"TASK": "input", "MODEL": "m"})
    contract = ISSUER.issue(spec, 1, None, spec.agent.env_map)
    assert json.loads(contract.env["DARL_TASK"]) == task
    assert contract.env["TASK"] == expected and contract.env["MODEL"] == "m"


def test_a_list_task_is_indexed() -> None:
    assert task_field(["a", ["b", "c"]], "1.0") == "b"
    assert env_map_values(["a", "b"], {"B": "input.1"}) == {"B": "b"}


def test_a_missing_or_null_task_is_a_clear_validation_error() -> None:
    with pytest.raises(ValidationError, match=r"task\n.*other than null"):
        rollout(None)
    with pytest.raises(ValidationError, match="valid JSON value"):
        rollout({1, 2})


def test_the_dataset_check_names_rows_without_the_path_as_written() -> None:
    rows = [TASK, {"question": "q"}, "a string task"]
    assert rows_missing(rows, "question", "env_map Q", "d.jsonl", "input.question") is not None
    error = rows_missing(rows, "meta.level", "env_map L", "d.jsonl", "input.meta.level")
    assert error is not None
    assert "2 of 3 rows have no field 'input.meta.level' (env_map L)" in str(error)
    assert rows_missing(rows[:2], "question", "env_map Q", "d.jsonl") is None


def test_every_attempt_gets_the_openai_anthropic_and_agent_lightning_variables() -> None:
    spec = rollout(TASK)
    contract = ISSUER.issue(spec, 2, None, {})
    env = contract.env
    assert env["OPENAI_BASE_URL"] == "http://gateway.test/rollouts/r1/v1"
    # The Anthropic SDK appends /v1/messages to its base URL.
    assert env["ANTHROPIC_BASE_URL"] == "http://gateway.test/rollouts/r1"
    assert env["ANTHROPIC_API_KEY"] == env["OPENAI_API_KEY"] == env["AGL_KEY"] == contract.token
    assert env["AGL_OPENAI_BASE_URL"] == (
        "http://gateway.test/proxy/rollout/r1/attempt/2/mode/train/openai/v1"
    )
    assert env["AGL_EVENT_URL"] == "http://gateway.test/api/rollouts/r1/attempt/2/events"
    assert contract.anthropic_base_url == env["ANTHROPIC_BASE_URL"]
