"""The calculator agents' training reward: DARL calls `score(task, answer, summary)` with the
arithmetic task, the answer the agent workflow returned and a summary of its model calls.
Dense on purpose, as the tutorial's: a model that answers at random writes a line of
characters, rarely ending in the right number, so `numeric_match` alone scores nearly every
answer 0 and GRPO has almost nothing to compare. Here half a point is for the shape the
instructions ask for, the number only: a quarter for the share of the answer's characters that
are digits of its numbers, a quarter for brevity (full up to three characters, 3/n for n); the
other half is for the right number (the answer's last number is the task's).
"""

import re

_INTEGER = re.compile(r"-?\d+")


def score(task: dict, answer: str | None, summary: object) -> float:
    text = (answer or "").strip()
    if not text:  # no answer: the model misbehaved, or stopped at once
        return 0.0
    numbers = _INTEGER.findall(text)
    digits = sum(len(number) for number in numbers) / len(text)
    brief = min(1.0, 3 / len(text))
    right = bool(numbers) and numbers[-1] == task["answer"]
    return (digits + brief) / 4 + right / 2
