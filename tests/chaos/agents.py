"""The chaos runs' agents, which keep their own account of what they did: each run of an
attempt and the call id of every answer they received (from the gateway's `X-Darl-Call-Id`;
one call a run, or `CHAOS_AGENT_CALLS`), in `agent-runs.jsonl`. The harness checks DARL's
records against it, not against DARL.

The digits agent HTTP service (on DARL's shared helper, journal and all):

    darl agent-service tests.chaos.agents:app
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Any

from fastapi import HTTPException

from darl.examples.agent_service import STATE_DIR_ENV, RolloutRequest, service_app
from darl.examples.digits.agent_service import DigitsAgent
from tests.chaos import CALLS_ENV, RUNS_LOG


def note(log: Path, **line: Any) -> None:
    """One line, one write: lines of concurrent agents never interleave."""
    with log.open("a") as f:
        f.write(json.dumps(line) + "\n")


class ChaosDigitsAgent(DigitsAgent):
    def __init__(self) -> None:
        super().__init__()
        self.runs_log = Path(os.environ[STATE_DIR_ENV]) / RUNS_LOG
        # The same completion, asked this many times (the answer is the last one's).
        self.calls = int(os.environ.get(CALLS_ENV, "1"))

    async def solve(self, request: RolloutRequest) -> dict[str, Any]:
        run = uuid.uuid4().hex
        note(self.runs_log, run=run, rollout_id=request.rollout_id, attempt=request.attempt)
        reply: dict[str, Any] = {}
        for _ in range(self.calls):
            try:
                reply = await super().solve(request)
            except HTTPException as err:
                note(self.runs_log, run=run, error=str(err.detail))
                raise
            note(self.runs_log, run=run, call_id=reply["metadata"]["call_id"])
        return reply


app = service_app(ChaosDigitsAgent(), "digits agent service (chaos log)")
