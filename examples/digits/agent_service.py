"""The digits agent as an HTTP service (DARL's agent HTTP service runner): one POST per
rollout attempt, one raw completion through the gateway, the sampled text as the answer.
It is deliberately lean (a shared httpx client, no SDK import per rollout): the demo needs
thousands of rollouts in minutes on two cores.

    darl agent-service darl.examples.digits.agent_service:app --port 8300

`Idempotency-Key` is honoured: an attempt POSTed again gets the run already under way.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
from fastapi import FastAPI, HTTPException

from darl.examples.agent_service import AgentService, RolloutRequest, service_app, task_text

# Unless the task says how many (`max_tokens`).
MAX_TOKENS = 4


class DigitsAgent(AgentService):
    """One raw completion per rollout attempt, with a client shared by all of them."""

    def __init__(self, remembered: int = 10_000, state_dir: Path | None = None) -> None:
        super().__init__(remembered, state_dir)
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(120.0))

    async def solve(self, request: RolloutRequest) -> dict[str, Any]:
        prompt = task_text(request.task, "prompt")
        if prompt is None:
            raise HTTPException(422, detail="the task has no string 'prompt'")
        max_tokens = int(
            request.task.get("max_tokens", MAX_TOKENS)
            if isinstance(request.task, dict)
            else MAX_TOKENS
        )
        choice, call_id = await self.complete(request, {"prompt": prompt, "max_tokens": max_tokens})
        # Which recorded call gave the answer (the gateway's call id): what the agent saw.
        return {"answer": choice["text"], "metadata": {"call_id": call_id}}

    async def complete(
        self, request: RolloutRequest, body: dict[str, Any]
    ) -> tuple[dict[str, Any], str | None]:
        """One raw completion through the gateway (`body`: the prompt, max_tokens and any
        more fields): its first choice and the gateway's call id. The agent fails (500) if the
        gateway fails it; whether DARL caused that, DARL knows (it records its own 5xx answers
        and outages) and then retries the attempt."""
        try:
            response = await self.client.post(
                f"{request.openai_base_url}/completions",
                headers={"Authorization": f"Bearer {request.api_key}"},
                json={"model": "policy", **body},
            )
        except httpx.TransportError as err:
            raise HTTPException(500, detail=f"gateway unreachable: {err!r}") from err
        if response.status_code >= 400:
            raise HTTPException(500, detail=f"gateway answered {response.status_code}")
        choice: dict[str, Any] = response.json()["choices"][0]
        return choice, response.headers.get("x-darl-call-id")


def create_service_app(agent: DigitsAgent | None = None) -> FastAPI:
    return service_app(agent or DigitsAgent(), "digits agent service")


app = create_service_app()
