"""The relay task: a multi-call agent passes a digit string on through `calls` model calls;
each call's prompt is the conversation so far (the previous answer included), and the reward
counts the calls whose answer is the task's digits. A mistake early is in every later call's
context, so the reward depends on the whole chain, and a group's members share its prefix.

Learnable from scratch by the tiny "digits" model (the demo's) with RL alone: the reward is
dense (credit per digit and for stopping at the right length, per call, as the digits task
gives it), so a random policy's groups carry signal.
"""

from __future__ import annotations

import json
import random
from collections.abc import Mapping
from typing import Any

from darl.examples.digits.task import SEPARATOR, TaskSpecError, digits_reward


def make_tasks(
    count: int, seed: int, digits: int = 1, calls: int = 3, max_tokens: int = 3
) -> list[dict[str, Any]]:
    """`count` tasks, the same for the same arguments: rows with `id`, `prompt` ("7="),
    `answer` ("7"), the number of `calls` the agent makes and the `max_tokens` of each."""
    if count < 0 or digits < 1 or calls < 2 or max_tokens < digits + 1:
        raise TaskSpecError(
            f"need count >= 0, digits >= 1, calls >= 2, max_tokens > digits, got {count}, "
            f"{digits}, {calls}, {max_tokens}"
        )
    rng = random.Random(seed)
    tasks = []
    for i in range(count):
        text = "".join(rng.choice("0123456789") for _ in range(digits))
        tasks.append(
            {
                "id": f"relay-{seed}-{i}",
                "prompt": text + SEPARATOR,
                "answer": text,
                "calls": calls,
                "max_tokens": max_tokens,
            }
        )
    return tasks


def answers_of(answer: str | None) -> list[str]:
    """The agent's answer is the JSON list of its calls' texts; anything else holds none."""
    if answer is None:
        return []
    try:
        texts = json.loads(answer)
    except json.JSONDecodeError:
        return []
    if not isinstance(texts, list):
        return []
    return [text for text in texts if isinstance(text, str)]


def relay_reward(task: Mapping[str, Any], answer: str | None, summary: object = None) -> float:
    """In [0, 1]: the mean over the task's `calls` of each call's digits reward (a call the
    agent never made scores 0). `summary` is not used."""
    calls = int(task["calls"])
    texts = answers_of(answer)[:calls]
    return sum(digits_reward(task, text) for text in texts) / calls


def success(task: Mapping[str, Any], answer: str | None) -> bool:
    """Every call answered exactly the task's digits."""
    texts = answers_of(answer)
    return len(texts) == int(task["calls"]) and all(t == str(task["answer"]) for t in texts)
