import asyncio
from decimal import Decimal

import pytest

from darl.activities.rewards import RewardFunctionError, final_number, score
from darl.workflows.contracts import RewardSpec, TrajectorySummary

SUMMARY = TrajectorySummary(
    rollout_id="r", attempt=1, calls=2, prompt_tokens=10, completion_tokens=5, call_ids=["a", "b"]
)


def run(spec: RewardSpec, task: object, answer: str | None) -> float:
    return asyncio.run(score(spec, task, answer, SUMMARY))


@pytest.mark.parametrize(
    ("text", "number"),
    [
        ("The answer is 42.", Decimal(42)),
        ("steps 3 then 4 #### 1,234", Decimal(1234)),
        ("-7", Decimal(-7)),
        ("about 3.50 dollars", Decimal("3.50")),
        ("no number", None),
        (None, None),
    ],
)
def test_final_number_follows_gsm8k(text: str | None, number: Decimal | None) -> None:
    assert final_number(text) == number


def test_numeric_match_compares_numbers_not_text() -> None:
    spec = RewardSpec(function="numeric_match")
    assert run(spec, {"answer": "#### 12"}, "so it is 12.0") == 1.0
    assert run(spec, {"answer": "12"}, "13") == 0.0
    assert run(spec, {"answer": "12"}, None) == 0.0


def test_exact_match_ignores_case_and_spacing_only() -> None:
    spec = RewardSpec(function="exact_match", answer_key="label")
    assert run(spec, {"label": "Paris"}, "  paris ") == 1.0
    assert run(spec, {"label": "Paris"}, "Paris, France") == 0.0


def test_a_missing_reference_is_an_error_not_a_zero() -> None:
    with pytest.raises(RewardFunctionError, match="no reference"):
        run(RewardSpec(function="exact_match"), {"question": "q"}, "a")


@pytest.mark.parametrize(
    ("task", "kind"), [("What is 2 + 2?", "string"), ([1, 2], "list"), (4, "number")]
)
def test_the_built_ins_say_clearly_that_they_need_an_object_task(task: object, kind: str) -> None:
    for function in ("exact_match", "numeric_match"):
        with pytest.raises(RewardFunctionError, match=f"the task is a {kind}, not an object"):
            run(RewardSpec(function=function), task, "4")


def answer_is_task(task: object, answer: str | None, summary: TrajectorySummary) -> float:
    return float(answer == str(task))


def test_a_function_of_your_own_gets_a_task_of_any_kind() -> None:
    spec = RewardSpec(function=f"{__name__}:answer_is_task")
    assert run(spec, "four", "four") == 1.0
    assert run(spec, 4, "4") == 1.0
    assert run(spec, ["a"], "b") == 0.0


def length_reward(task: dict, answer: str | None, summary: TrajectorySummary) -> float:
    return float(summary.completion_tokens) - len(answer or "")


async def async_reward(task: dict, answer: str | None, summary: TrajectorySummary) -> float:
    return 0.25


def not_a_number(task: dict, answer: str | None, summary: TrajectorySummary) -> object:
    return "high"


def test_module_functions_get_task_answer_and_summary() -> None:
    assert run(RewardSpec(function=f"{__name__}:length_reward"), {}, "abc") == 2.0
    assert run(RewardSpec(function=f"{__name__}:async_reward"), {}, None) == 0.25


@pytest.mark.parametrize(
    "name", ["nope", "no.such.module:f", f"{__name__}:missing", f"{__name__}:not_a_number"]
)
def test_unusable_reward_functions_fail_clearly(name: str) -> None:
    with pytest.raises(RewardFunctionError):
        run(RewardSpec(function=name), {"answer": "1"}, "1")
