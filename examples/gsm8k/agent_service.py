"""The GSM8K agent as an HTTP service (DARL's agent HTTP service runner): one POST per rollout
attempt, the same prompt and answer as `agent.py`, through one OpenAI SDK client whose pooled
connections every rollout shares (a step of verl's quickstart is 256 x 5 = 1,280 rollouts).

    darl agent-service darl.examples.gsm8k.agent_service:app --port 8300

`Idempotency-Key` is honoured: an attempt POSTed again gets the run already under way.
"""

from __future__ import annotations

from typing import Any

import httpx
import openai
from fastapi import FastAPI, HTTPException
from openai import AsyncOpenAI

from darl.examples.agent_service import AgentService, RolloutRequest, service_app, task_text
from darl.examples.gsm8k.agent import MAX_TOKENS, messages


class GSM8KAgent(AgentService):
    """One chat completion per rollout attempt; the whole reply is the answer."""

    def __init__(
        self,
        remembered: int = 10_000,
        http_client: httpx.AsyncClient | None = None,
        max_retries: int = 6,
    ) -> None:
        super().__init__(remembered)
        # Each rollout has its own gateway URL and token; `with_options` copies this client
        # for it and keeps the shared connection pool.
        self.client = AsyncOpenAI(
            base_url="http://unset.invalid/v1",
            api_key="unset",
            max_retries=max_retries,
            http_client=http_client or httpx.AsyncClient(timeout=httpx.Timeout(300.0)),
        )

    async def solve(self, request: RolloutRequest) -> dict[str, Any]:
        question = task_text(request.task, "question")
        if question is None:
            raise HTTPException(422, detail="the task has no string 'question'")
        client = self.client.with_options(base_url=request.openai_base_url, api_key=request.api_key)
        try:
            completion = await client.chat.completions.create(
                model="policy", messages=messages(request.task), max_tokens=MAX_TOKENS
            )
        except openai.APIStatusError as err:
            # The agent fails (500); whether DARL's gateway caused it, DARL knows (it records
            # its own 5xx answers and outages) and then retries the attempt.
            raise HTTPException(500, detail=f"gateway answered {err.status_code}") from err
        except openai.APIConnectionError as err:
            raise HTTPException(500, detail=f"gateway unreachable: {err}") from err
        text = completion.choices[0].message.content or ""
        return {"answer": text, "metadata": {"calls": 1}}


def create_service_app(agent: GSM8KAgent | None = None) -> FastAPI:
    return service_app(agent or GSM8KAgent(), "GSM8K agent service")


app = create_service_app()
