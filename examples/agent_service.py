"""What every example agent HTTP service shares: the request DARL's HTTP runner POSTs, one run
per rollout attempt (`Idempotency-Key`: an attempt POSTed again gets the run already under
way, never a second one), and the FastAPI app around it.

With a state directory (`darl agent-service --state-dir`, or `DARL_AGENT_STATE_DIR`) the
service keeps a journal of the attempts it accepted and the replies it gave, in SQLite: after
a restart a finished attempt POSTed again gets its reply, and an attempt that was running when
the service died gets 410 Gone, so DARL gives the rollout a fresh attempt (with a new token)
instead of this service running the same attempt twice (rule 7).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sqlite3
import threading
from abc import ABC, abstractmethod
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

from fastapi import FastAPI, Header, HTTPException
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

log = logging.getLogger(__name__)

STATE_DIR_ENV = "DARL_AGENT_STATE_DIR"
# HTTP status of an attempt this service accepted but lost (DARL's HTTP runner retries the
# rollout with a fresh attempt).
LOST = 410


def task_text(task: Any, field: str) -> str | None:
    """The task's string `field`, or the task itself when it is a string (a task may be any
    JSON value); None when it has neither."""
    value = task.get(field) if isinstance(task, dict) else task
    return value if isinstance(value, str) else None


class RolloutRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    rollout_id: str
    attempt: int
    # Any JSON value: an object (a dataset row), a string, a list, a number.
    task: Any
    openai_base_url: str
    api_key: str


@dataclass(frozen=True)
class Reply:
    status: int
    body: dict[str, Any]

    def response(self) -> JSONResponse:
        return JSONResponse(self.body, status_code=self.status)


class AttemptJournal:
    """Accepted attempts and their replies, by idempotency key, in one SQLite file (WAL):
    an accepted attempt is on disk before its agent starts, a reply before it is sent."""

    def __init__(self, path: Path, remembered: int) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._lock = threading.Lock()
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.execute(
                "CREATE TABLE IF NOT EXISTS attempts (key TEXT PRIMARY KEY, "
                "status INTEGER, reply TEXT, seq INTEGER)"
            )
            # Only the last `remembered` attempts: DARL never re-POSTs an old one.
            self._db.execute(
                "DELETE FROM attempts WHERE seq <= (SELECT MAX(seq) FROM attempts) - ?",
                (remembered,),
            )

    def get(self, key: str) -> Reply | bool | None:
        """The stored reply; True if accepted and never answered (lost); None if unknown."""
        with self._lock:
            row = self._db.execute(
                "SELECT status, reply FROM attempts WHERE key = ?", (key,)
            ).fetchone()
        if row is None:
            return None
        if row[0] is None:
            return True
        return Reply(int(row[0]), json.loads(row[1]))

    def accept(self, key: str) -> None:
        with self._lock:
            self._db.execute(
                "INSERT OR IGNORE INTO attempts (key, seq) VALUES "
                "(?, COALESCE((SELECT MAX(seq) FROM attempts), 0) + 1)",
                (key,),
            )

    def finish(self, key: str, reply: Reply) -> None:
        with self._lock:
            self._db.execute(
                "UPDATE attempts SET status = ?, reply = ? WHERE key = ?",
                (reply.status, json.dumps(reply.body), key),
            )

    def close(self) -> None:
        with self._lock:
            self._db.close()


class AgentService(ABC):
    """Runs `solve` once per rollout attempt; remembers the last `remembered` attempts (on
    disk too, with a state directory)."""

    def __init__(self, remembered: int = 10_000, state_dir: Path | None = None) -> None:
        self.runs: OrderedDict[str, asyncio.Task[Reply]] = OrderedDict()
        self.remembered = remembered
        self.started = 0
        if state_dir is None and os.environ.get(STATE_DIR_ENV):
            state_dir = Path(os.environ[STATE_DIR_ENV])
        self.journal = (
            AttemptJournal(state_dir / "attempts.sqlite", remembered) if state_dir else None
        )
        self._warned = False

    async def handle(self, request: RolloutRequest, key: str) -> Reply:
        run = self.runs.get(key)
        if run is None:
            # Registered before any await: a second POST of the key finds this run.
            run = self.runs[key] = asyncio.create_task(self._attempt(request, key))
            while len(self.runs) > self.remembered:
                self.runs.popitem(last=False)
        return await asyncio.shield(run)

    async def _attempt(self, request: RolloutRequest, key: str) -> Reply:
        """The attempt's reply: the journal's if this service already answered it (before a
        restart), 410 if it accepted it and then lost it, else a run of the agent."""
        known = await self._known(key)
        if isinstance(known, Reply):
            return known
        if known is True:
            return Reply(
                LOST,
                {
                    "detail": f"attempt {key} was running when this agent service stopped; "
                    "it will not run it again"
                },
            )
        if self.journal is not None:
            await asyncio.to_thread(self.journal.accept, key)
        self.started += 1
        return await self._run(request, key)

    async def _known(self, key: str) -> Reply | bool | None:
        if self.journal is None:
            if not self._warned:
                self._warned = True
                log.warning(
                    "%s keeps its attempts in memory only (no state dir): after a restart it "
                    "cannot tell an attempt it lost from a new one",
                    type(self).__name__,
                )
            return None
        return await asyncio.to_thread(self.journal.get, key)

    async def _run(self, request: RolloutRequest, key: str) -> Reply:
        try:
            reply = Reply(200, await self.solve(request))
        except HTTPException as err:
            reply = Reply(err.status_code, {"detail": err.detail})
        except Exception as err:
            # The agent crashed: that is its reply (logged with its traceback).
            log.exception("agent of %s crashed", key)
            reply = Reply(500, {"detail": f"the agent crashed: {err!r}"})
        if self.journal is not None:
            await asyncio.to_thread(self.journal.finish, key, reply)
        return reply

    @abstractmethod
    async def solve(self, request: RolloutRequest) -> dict[str, Any]:
        """Run the agent; the reply is its report: `{"answer"?, "reward"?, "metadata"?}`.
        Raise HTTPException for a failure the reply should carry."""


def service_app(service: AgentService, title: str) -> FastAPI:
    api = FastAPI(title=title)
    api.state.service = service

    @api.post("/rollouts")
    async def rollout(
        body: RolloutRequest, idempotency_key: Annotated[str | None, Header()] = None
    ) -> JSONResponse:
        reply = await service.handle(body, idempotency_key or f"{body.rollout_id}/{body.attempt}")
        return reply.response()

    @api.get("/healthz")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    return api
