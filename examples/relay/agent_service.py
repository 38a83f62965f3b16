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
            choice, call_id = await self.complete(
                request, {"prompt": ids, "max_tokens": max_tokens, "return_token_ids": True}
            )
            texts.append(choice["text"])
            call_ids.append(call_id)
            sent = choice["prompt_token_ids"]
            # The prompt ends with the separator: its id is the prompt's last.
            ids = [*sent, *choice["token_ids"], sent[-1]]
        return {"answer": json.dumps(texts), "metadata": {"call_ids": call_ids}}


def create_service_app(agent: RelayAgent | None = None) -> FastAPI:
    return service_app(agent or RelayAgent(), "relay agent service")


app = create_service_app()
