"""The tutorial's reward: DARL calls `score(task, answer, summary)` after the agent exits, with
the task row, the answer the agent reported and a summary of its model calls. Dense on purpose:
half a point for the right digit, half for stopping right after it, so even an untrained
policy's answers differ in reward, and GRPO has something to learn from.
"""


def score(task: dict, answer: str | None, summary: object) -> float:
    if answer is None:  # the agent reported no answer
        return 0.0
    right_digit = answer[:1] == task["answer"]
    stopped = len(answer) == len(task["answer"])
    return (right_digit + stopped) / 2
