"""Reward functions by name: `exact_match`, `numeric_match` (GSM8K-style final number), or any
`module:function` called as `fn(task, answer, summary)` (sync or async) returning a number.
The task is any JSON value; the built-ins read the reference answer of an object task."""

from __future__ import annotations

import importlib
import inspect
import math
import re
from collections.abc import Awaitable, Callable, Mapping
from decimal import Decimal, InvalidOperation
from typing import Any

from darl.activities.errors import ActivitiesError
from darl.workflows.contracts import RewardSpec, TrajectorySummary

# The task is the rollout's, any JSON value (an object, a list, a string, a number).
RewardFn = Callable[[Any, str | None, TrajectorySummary], float | Awaitable[float]]


class RewardFunctionError(ActivitiesError, ValueError):
    """The reward spec names no usable function, or the function returned no finite number."""


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def final_number(text: str | None) -> Decimal | None:
    """The answer's number: what follows the last `####` if there is one, else the last number
    in the text (GSM8K's convention). Thousands separators are ignored."""
    if text is None:
        return None
    if "####" in text:
        text = text.rsplit("####", 1)[1]
    matches = _NUMBER.findall(text)
    if not matches:
        return None
    try:
        return Decimal(matches[-1].replace(",", ""))
    except InvalidOperation:
        return None


def _normalize(text: str) -> str:
    return " ".join(text.split()).casefold()


def _json_kind(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "list"
    return type(value).__name__


def _reference(task: Any, answer_key: str) -> Any:
    if not isinstance(task, Mapping):
        raise RewardFunctionError(
            f"the task is a {_json_kind(task)}, not an object with the reference answer "
            f"field {answer_key!r}: give a reward function of your own for such tasks"
        )
    if answer_key not in task:
        raise RewardFunctionError(f"task has no reference answer field {answer_key!r}")
    return task[answer_key]


def exact_match(answer_key: str) -> RewardFn:
    def reward(task: Any, answer: str | None, summary: TrajectorySummary) -> float:
        reference = str(_reference(task, answer_key))
        return float(answer is not None and _normalize(answer) == _normalize(reference))

    return reward


def numeric_match(answer_key: str) -> RewardFn:
    def reward(task: Any, answer: str | None, summary: TrajectorySummary) -> float:
        expected = final_number(str(_reference(task, answer_key)))
        if expected is None:
            raise RewardFunctionError(f"task field {answer_key!r} holds no number")
        got = final_number(answer)
        return float(got is not None and got == expected)

    return reward


BUILTIN: dict[str, Callable[[str], RewardFn]] = {
    "exact_match": exact_match,
    "numeric_match": numeric_match,
}


def resolve(spec: RewardSpec) -> RewardFn:
    if spec.function is None:
        raise RewardFunctionError("the reward spec names no function (the agent reports it)")
    if spec.function in BUILTIN:
        return BUILTIN[spec.function](spec.answer_key)
    module_name, sep, attr = spec.function.partition(":")
    if not sep or not module_name or not attr:
        raise RewardFunctionError(
            f"reward function {spec.function!r} is not a built-in "
            f"({', '.join(sorted(BUILTIN))}) nor 'module:function'"
        )
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise RewardFunctionError(f"cannot load reward function {spec.function!r}: {err}") from err
    if not callable(fn):
        raise RewardFunctionError(f"reward function {spec.function!r} is not callable")
    return fn


def check(spec: RewardSpec, task: Any) -> None:
    """Raise RewardFunctionError unless the reward can score this task: its function loads
    and, for a built-in, the task has the reference answer it reads."""
    if spec.function is None:
        return
    resolve(spec)
    if spec.function in BUILTIN:
        _reference(task, spec.answer_key)


async def score(
    spec: RewardSpec, task: Any, answer: str | None, summary: TrajectorySummary
) -> float:
    value = resolve(spec)(task, answer, summary)
    if inspect.isawaitable(value):
        value = await value
    if not isinstance(value, int | float) or not math.isfinite(value):
        raise RewardFunctionError(f"reward function returned {value!r}, not a finite number")
    return float(value)
