"""The arithmetic agent as an HTTP service, for DARL's agent HTTP service runner (the model of
the verl agent-lightning-like recipe): DARL POSTs a rollout, the service answers with the
agent's report. No process start per rollout, so it is cheap.

    uvicorn darl.examples.arithmetic.agent_service:app --host 127.0.0.1 --port 8300

It honours `Idempotency-Key`: a rollout attempt POSTed again (a worker crashed and its retry
re-attaches) gets the answer of the run already under way, never a second run.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, HTTPException
from openai import AsyncOpenAI

from darl.examples.agent_service import AgentService, RolloutRequest, service_app, task_text
from darl.examples.arithmetic.agent import SYSTEM, final_answer


class ArithmeticService(AgentService):
    """Runs the single-turn arithmetic agent once per rollout attempt."""

    async def solve(self, request: RolloutRequest) -> dict[str, Any]:
        question = task_text(request.task, "question")
        if question is None:
            raise HTTPException(422, detail="the task has no string 'question'")
        client = AsyncOpenAI(
            base_url=request.openai_base_url, api_key=request.api_key, max_retries=6
        )
        async with client:
            completion = await client.chat.completions.create(
                model="policy",
                messages=[
                    {"role": "system", "content": SYSTEM},
                    {"role": "user", "content": question},
                ],
                max_tokens=12,
            )
        text = completion.choices[0].message.content or ""
        return {"answer": final_answer(text), "metadata": {"calls": 1, "text": text}}


def create_service_app(service: ArithmeticService | None = None) -> FastAPI:
    return service_app(service or ArithmeticService(), "arithmetic agent service")


app = create_service_app()
