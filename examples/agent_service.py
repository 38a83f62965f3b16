"""What every example agent HTTP service shares: the request DARL's HTTP runner POSTs, one run
per rollout attempt (`Idempotency-Key`: an attempt POSTed again gets the run already under
way, never a second one), and the FastAPI app around it."""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections import OrderedDict
from typing import Annotated, Any

from fastapi import FastAPI, Header
from pydantic import BaseModel, ConfigDict


class RolloutRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    rollout_id: str
    attempt: int
    task: dict[str, Any]
    openai_base_url: str
    api_key: str


class AgentService(ABC):
    """Runs `solve` once per rollout attempt; remembers the last `remembered` attempts."""

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

    @abstractmethod
    async def solve(self, request: RolloutRequest) -> dict[str, Any]:
        """Run the agent; the reply is its report: `{"answer"?, "reward"?, "metadata"?}`."""


def service_app(service: AgentService, title: str) -> FastAPI:
    api = FastAPI(title=title)
    api.state.service = service

    @api.post("/rollouts")
    async def rollout(
        body: RolloutRequest, idempotency_key: Annotated[str | None, Header()] = None
    ) -> dict[str, Any]:
        return await service.handle(body, idempotency_key or f"{body.rollout_id}/{body.attempt}")

    @api.get("/healthz")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    return api
