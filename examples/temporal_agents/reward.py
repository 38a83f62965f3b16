"""The calculator agents' training reward: DARL calls `score(task, answer, summary)` with the
arithmetic task, the answer the agent workflow returned and a summary of its model calls.
Dense on purpose, as the tutorial's: a model that answers at random writes a line of
characters, never the number, so `numeric_match` alone scores every answer 0 and GRPO has
nothing to compare. Here half a point is for the shape the instructions ask for, the number
only (the share of the answer's characters that are the number's: 1 for "7", 0.5 for "7."),
and half for the right number (the last number in the answer, as `numeric_match` reads it).
"""

import re

_INTEGER = re.compile(r"-?\d+")


def score(task: dict, answer: str | None, summary: object) -> float:
    text = (answer or "").strip()
    if not text:  # no answer: the model misbehaved, or stopped at once
        return 0.0
    numbers = _INTEGER.findall(text)
    shape = sum(len(number) for number in numbers) / len(text)
    right = bool(numbers) and numbers[-1] == task["answer"]
    return (shape + right) / 2
