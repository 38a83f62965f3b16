"""A test agent HTTP service on DARL's shared helper: each attempt makes `calls` chat calls
through the gateway (the task says how many) with `pause` seconds before each, notes each run
it starts in `runs.jsonl` beside its journal, and answers with the call ids it received.

    darl agent-service tests.agents.slow_service:app
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import httpx
from fastapi import HTTPException

from darl.examples.agent_service import STATE_DIR_ENV, AgentService, RolloutRequest, service_app


class SlowService(AgentService):
    def __init__(self) -> None:
        super().__init__()
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(60.0))
        self.runs_log = Path(os.environ[STATE_DIR_ENV]) / "runs.jsonl"

    async def solve(self, request: RolloutRequest) -> dict[str, Any]:
        with self.runs_log.open("a") as log:
            log.write(json.dumps({"rollout_id": request.rollout_id, "attempt": request.attempt}))
            log.write("\n")
        received = []
        messages = [{"role": "user", "content": "2 + 2 ="}]
        for _ in range(int(request.task.get("calls", 2))):
            await asyncio.sleep(float(request.task.get("pause", 1.0)))
            response = await self.client.post(
                f"{request.openai_base_url}/chat/completions",
                headers={"Authorization": f"Bearer {request.api_key}"},
                json={"model": "m", "messages": messages, "max_tokens": 3},
            )
            if response.status_code != 200:
                raise HTTPException(500, detail=f"gateway answered {response.status_code}")
            received.append(response.headers["x-darl-call-id"])
            text = response.json()["choices"][0]["message"]["content"] or ""
            messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "+1"}]
        return {"answer": "done", "reward": 1.0, "metadata": {"received": received}}


app = service_app(SlowService(), "slow test agent service")
