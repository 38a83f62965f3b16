"""The replay test agent (tests/agents/replay_agent.py) as an agent HTTP service: DARL POSTs an
attempt, the service runs the episode on a thread of its own and answers with its report. Its
settings come from the service's environment; at the kill point it waits, so the test kills
the whole service from outside there.

    darl agent-service tests.agents.replay_service:app
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
from pathlib import Path
from typing import Any

from darl.examples.agent_service import AgentService, RolloutRequest, service_app
from tests.agents.replay_agent import run_episode


class ReplayService(AgentService):
    async def solve(self, request: RolloutRequest) -> dict[str, Any]:
        settings = {
            **os.environ,
            "OPENAI_BASE_URL": request.openai_base_url,
            "OPENAI_API_KEY": request.api_key,
            "ANTHROPIC_BASE_URL": request.openai_base_url.removesuffix("/v1"),
            "ANTHROPIC_API_KEY": request.api_key,
            "DARL_ROLLOUT_ID": request.rollout_id,
            "DARL_ATTEMPT": str(request.attempt),
            "DARL_TASK": json.dumps(request.task),
        }

        def wait_to_be_killed() -> None:
            marker = Path(settings["MARKER_DIR"]) / f"{request.rollout_id}.{request.attempt}"
            marker.write_text(str(os.getpid()))
            threading.Event().wait()

        return await asyncio.to_thread(run_episode, settings, wait_to_be_killed)


app = service_app(ReplayService(), "replay test agent service")
