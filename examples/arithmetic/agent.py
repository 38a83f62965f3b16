"""An arithmetic agent written with the official OpenAI SDK and nothing of DARL but two things:
it reads its task from DARL_TASK and reports its answer to DARL_RESULT_URL.

The SDK finds the gateway and the rollout's token in OPENAI_BASE_URL / OPENAI_API_KEY by itself.
Run it by hand against any OpenAI-compatible server the same way.
"""

from __future__ import annotations

import json
import os
import re

import httpx
from openai import OpenAI

SYSTEM = "Answer with the number only."


def final_answer(text: str) -> str:
    numbers = re.findall(r"-?\d+", text)
    return numbers[-1] if numbers else text.strip()


def report(answer: str, calls: int) -> None:
    url = os.environ.get("DARL_RESULT_URL")
    if url:
        response = httpx.post(
            url,
            json={"answer": answer, "metadata": {"calls": calls}},
            headers={"Authorization": f"Bearer {os.environ['OPENAI_API_KEY']}"},
            timeout=30,
        )
        response.raise_for_status()


def main() -> None:
    task = json.loads(os.environ["DARL_TASK"])
    client = OpenAI(max_retries=6)
    completion = client.chat.completions.create(
        model=os.environ.get("OPENAI_MODEL", "policy"),
        messages=[
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": task["question"]},
        ],
        max_tokens=int(os.environ.get("AGENT_MAX_TOKENS", "12")),
        stream=False,
    )
    text = completion.choices[0].message.content or ""
    answer = final_answer(text)
    print(f"question: {task['question']!r} model said: {text!r} answer: {answer!r}")
    report(answer, calls=1)


if __name__ == "__main__":
    main()
