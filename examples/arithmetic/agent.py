"""An arithmetic agent written with the official OpenAI SDK and nothing of DARL but two things:
it reads its task from DARL_TASK and reports its answer to DARL_RESULT_URL.

The SDK finds the gateway and the rollout's token in OPENAI_BASE_URL / OPENAI_API_KEY by itself.
Run it by hand against any OpenAI-compatible server the same way.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

import httpx
from openai import OpenAI

SYSTEM = "Answer with the number only."


def final_answer(text: str) -> str:
    numbers = re.findall(r"-?\d+", text)
    return numbers[-1] if numbers else text.strip()


def report_result(body: dict[str, Any]) -> None:
    """POST the report to DARL_RESULT_URL (if set) with the rollout token (the contract gives
    it as OPENAI_API_KEY and ANTHROPIC_API_KEY alike)."""
    url = os.environ.get("DARL_RESULT_URL")
    if url:
        token = os.environ.get("OPENAI_API_KEY") or os.environ["ANTHROPIC_API_KEY"]
        response = httpx.post(
            url, json=body, headers={"Authorization": f"Bearer {token}"}, timeout=30
        )
        response.raise_for_status()


def report(answer: str, calls: int) -> None:
    report_result({"answer": answer, "metadata": {"calls": calls}})


def question_of(task: object) -> str:
    """The task's `question`, or the task itself when it is a string."""
    question = task.get("question") if isinstance(task, dict) else task
    if not isinstance(question, str):
        raise SystemExit(f"the task has no string 'question': {str(task)[:200]}")
    return question


def main() -> None:
    task = json.loads(os.environ["DARL_TASK"])
    question = question_of(task)
    client = OpenAI(max_retries=6)
    completion = client.chat.completions.create(
        model=os.environ.get("OPENAI_MODEL", "policy"),
        messages=[
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": question},
        ],
        max_tokens=int(os.environ.get("AGENT_MAX_TOKENS", "12")),
        stream=False,
    )
    text = completion.choices[0].message.content or ""
    answer = final_answer(text)
    print(f"question: {question!r} model said: {text!r} answer: {answer!r}")
    report(answer, calls=1)


if __name__ == "__main__":
    main()
