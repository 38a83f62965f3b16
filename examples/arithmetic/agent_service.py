"""The arithmetic agent as an HTTP service, for DARL's agent HTTP service runner (the model of
the verl agent-lightning-like recipe): DARL POSTs a rollout, the service answers with the
agent's report. No process start per rollout, so it is cheap.

    uvicorn examples.arithmetic.agent_service:app --host 127.0.0.1 --port 8300

It honours `Idempotency-Key`: a rollout attempt POSTed again (a worker crashed and its retry
re-attaches) gets the answer of the run already under way, never a second run.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from typing import Annotated, Any

from fastapi import FastAPI, Header
from openai import AsyncOpenAI
from pydantic import BaseModel, ConfigDict

from examples.arithmetic.agent import SYSTEM, final_answer


class RolloutRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    rollout_id: str
    attempt: int
    task: dict[str, Any]
    openai_base_url: str
    api_key: str


class ArithmeticService:
    """Runs one agent per rollout attempt; remembers the last `remembered` attempts."""

    def __init__(self, remembered: int = 10_000) -> None:
        self.runs: OrderedDict[str, asyncio.Task[dict[str, Any]]] = OrderedDict()
        self.remembered = remembered
        self.started = 0

    async def handle(self, request: RolloutRequest, key: str) -> dict[str, Any]:
        run = self.runs.get(key)
        if run is None:
            self.started += 1
            run = self.runs[key] = asyncio.create_task(self.solve(request))
            while len(self.runs) > self.remembered:
                self.runs.popitem(last=False)
        return await asyncio.shield(run)

    async def solve(self, request: RolloutRequest) -> dict[str, Any]:
        client = AsyncOpenAI(
            base_url=request.openai_base_url, api_key=request.api_key, max_retries=6
        )
        async with client:
            completion = await client.chat.completions.create(
                model="policy",
                messages=[
                    {"role": "system", "content": SYSTEM},
                    {"role": "user", "content": request.task["question"]},
                ],
                max_tokens=12,
            )
        text = completion.choices[0].message.content or ""
        return {"answer": final_answer(text), "metadata": {"calls": 1, "text": text}}


def create_service_app(service: ArithmeticService | None = None) -> FastAPI:
    service = service or ArithmeticService()
    api = FastAPI(title="arithmetic agent service")
    api.state.service = service

    @api.post("/rollouts")
    async def rollout(
        body: RolloutRequest, idempotency_key: Annotated[str | None, Header()] = None
    ) -> dict[str, Any]:
        return await service.handle(body, idempotency_key or f"{body.rollout_id}/{body.attempt}")

    return api


app = create_service_app()
