"""The GSM8K agent: a plain OpenAI-SDK program that asks the model once with verl's quickstart
prompt (the question, a space, the instruction to end with "####") and reports the whole
reply as its answer, for the reward to score as verl scores it. Nothing of DARL but the task in
DARL_TASK and the report to DARL_RESULT_URL; the SDK finds the gateway and the rollout's token
in OPENAI_BASE_URL / OPENAI_API_KEY by itself.

    python -m darl.examples.gsm8k.agent      # with DARL_TASK='{"question": "..."}' and OPENAI_*

DARL runs it per rollout with the local runner (`kind: local`); `agent_service.py` is the same
agent as an HTTP service, which `train.yaml` uses (no process start per rollout).
"""

from __future__ import annotations

import json
import os
from typing import Any

import httpx
from openai import OpenAI

# verl's examples/data_preprocess/gsm8k.py, word for word.
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
# verl's quickstart: data.max_response_length=256.
MAX_TOKENS = 256


def messages(task: Any) -> list[dict[str, str]]:
    """The prompt verl's preprocessing writes: one user message, no system message. The task
    is a row with a `question`, or the question itself."""
    question = task.get("question") if isinstance(task, dict) else task
    if not isinstance(question, str):
        raise ValueError(f"the task has no string 'question': {str(task)[:200]}")
    return [{"role": "user", "content": f"{question} {INSTRUCTION}"}]


def solve(client: OpenAI, task: Any, max_tokens: int = MAX_TOKENS) -> str:
    """One chat completion; the reply as it came, "#### <number>" and all."""
    completion = client.chat.completions.create(
        model=os.environ.get("OPENAI_MODEL", "policy"),
        messages=messages(task),
        max_tokens=max_tokens,
    )
    return completion.choices[0].message.content or ""


def report(answer: str, result_url: str | None, token: str, client: httpx.Client) -> None:
    if result_url:
        response = client.post(
            result_url,
            json={"answer": answer, "metadata": {"calls": 1}},
            headers={"Authorization": f"Bearer {token}"},
        )
        response.raise_for_status()


def main() -> None:
    task = json.loads(os.environ["DARL_TASK"])
    max_tokens = int(os.environ.get("AGENT_MAX_TOKENS", MAX_TOKENS))
    with OpenAI(max_retries=6) as client, httpx.Client(timeout=30) as http:
        answer = solve(client, task, max_tokens)
        report(answer, os.environ.get("DARL_RESULT_URL"), client.api_key, http)
    task_id = task.get("id") if isinstance(task, dict) else None
    print(f"task {task_id}: {len(answer)} characters, ends {answer[-60:]!r}")


if __name__ == "__main__":
    main()
