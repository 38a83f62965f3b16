"""The relay agent as an HTTP service (DARL's agent HTTP service runner): per rollout attempt,
`calls` raw completions through the gateway, token ids in and out. Call 0 sends the task's
prompt ("7="); each later call sends the previous prompt's ids, the previous answer's ids and
the separator's id again, so the conversation is sent whole and its calls merge into one
training row. The answer is the JSON list of the calls' texts.

    darl agent-service darl.examples.relay.agent_service:app --port 8300

Lean for the same reason as the digits service: the benchmark runs thousands of rollouts on
two cores.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
from fastapi import FastAPI, HTTPException

from darl.examples.agent_service import RolloutRequest, service_app, task_text
from darl.examples.digits.agent_service import DigitsAgent

# Unless the task says (`calls`, `max_tokens`).
CALLS = 3
MAX_TOKENS = 3


class RelayAgent(DigitsAgent):
    """`calls` completions per rollout attempt, each fed the previous answer (the digits
    agent's shared client, its own loop)."""

    async def solve(self, request: RolloutRequest) -> dict[str, Any]:
        prompt = task_text(request.task, "prompt")
        if prompt is None:
            raise HTTPException(422, detail="the task has no string 'prompt'")
        task = request.task if isinstance(request.task, dict) else {}
        calls, max_tokens = int(task.get("calls", CALLS)), int(task.get("max_tokens", MAX_TOKENS))
        texts: list[str] = []
        call_ids: list[str | None] = []
        ids: list[int] | str = prompt
        for _ in range(calls):
            choice, call_id = await self._complete(request, ids, max_tokens)
            texts.append(choice["text"])
            call_ids.append(call_id)
            sent = choice["prompt_token_ids"]
            # The prompt ends with the separator: its id is the prompt's last.
            ids = [*sent, *choice["token_ids"], sent[-1]]
        return {"answer": json.dumps(texts), "metadata": {"call_ids": call_ids}}

    async def _complete(
        self, request: RolloutRequest, prompt: list[int] | str, max_tokens: int
    ) -> tuple[dict[str, Any], str | None]:
        # The agent fails (500) if the gateway fails it; DARL knows whether it caused that.
        try:
            response = await self.client.post(
                f"{request.openai_base_url}/completions",
                headers={"Authorization": f"Bearer {request.api_key}"},
                json={
                    "model": "policy",
                    "prompt": prompt,
                    "max_tokens": max_tokens,
                    "return_token_ids": True,
                },
            )
        except httpx.TransportError as err:
            raise HTTPException(500, detail=f"gateway unreachable: {err!r}") from err
        if response.status_code >= 400:
            raise HTTPException(500, detail=f"gateway answered {response.status_code}")
        return response.json()["choices"][0], response.headers.get("x-darl-call-id")


def create_service_app(agent: RelayAgent | None = None) -> FastAPI:
    return service_app(agent or RelayAgent(), "relay agent service")


app = create_service_app()
