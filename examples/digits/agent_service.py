"""The digits agent as an HTTP service (DARL's agent HTTP service runner): one POST per
rollout attempt, one raw completion through the gateway, the sampled text as the answer.
It is deliberately lean (a shared httpx client, no SDK import per rollout): the demo needs
thousands of rollouts in minutes on two cores.

    darl agent-service examples.digits.agent_service:app --port 8300

`Idempotency-Key` is honoured: an attempt POSTed again gets the run already under way.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from typing import Annotated, Any

import httpx
from fastapi import FastAPI, Header, HTTPException
from pydantic import BaseModel, ConfigDict

# Unless the task says how many (`max_tokens`).
MAX_TOKENS = 4


class RolloutRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    rollout_id: str
    attempt: int
    task: dict[str, Any]
    openai_base_url: str
    api_key: str


class DigitsAgent:
    """Runs one completion per attempt; remembers the last `remembered` attempts."""

    def __init__(self, remembered: int = 10_000) -> None:
        self.runs: OrderedDict[str, asyncio.Task[dict[str, Any]]] = OrderedDict()
        self.remembered = remembered
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(120.0))

    async def handle(self, request: RolloutRequest, key: str) -> dict[str, Any]:
        run = self.runs.get(key)
        if run is None:
            run = self.runs[key] = asyncio.create_task(self.solve(request))
            while len(self.runs) > self.remembered:
                self.runs.popitem(last=False)
        return await asyncio.shield(run)

    async def solve(self, request: RolloutRequest) -> dict[str, Any]:
        prompt = request.task.get("prompt")
        if not isinstance(prompt, str):
            raise HTTPException(422, detail="the task has no string 'prompt'")
        response = await self.client.post(
            f"{request.openai_base_url}/completions",
            headers={"Authorization": f"Bearer {request.api_key}"},
            json={
                "model": "policy",
                "prompt": prompt,
                "max_tokens": int(request.task.get("max_tokens", MAX_TOKENS)),
            },
        )
        if response.status_code >= 400:
            # The attempt failed at the gateway: say so (the runner reports a failed agent).
            raise HTTPException(502, detail=f"gateway answered {response.status_code}")
        text = response.json()["choices"][0]["text"]
        return {"answer": text}


def create_service_app(agent: DigitsAgent | None = None) -> FastAPI:
    agent = agent or DigitsAgent()
    api = FastAPI(title="digits agent service")

    @api.post("/rollouts")
    async def rollout(
        body: RolloutRequest, idempotency_key: Annotated[str | None, Header()] = None
    ) -> dict[str, Any]:
        return await agent.handle(body, idempotency_key or f"{body.rollout_id}/{body.attempt}")

    @api.get("/healthz")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    return api


app = create_service_app()
