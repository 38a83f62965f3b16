"""Agent HTTP service runner: the agent already runs as a service; an attempt is one POST.

The request carries the task and the agent contract (base URL, token, result URL, traceparent)
and `Idempotency-Key: <rollout>/<attempt>`: after a worker crash the retried activity POSTs the
same key again, and a service that honours it answers with the attempt already running rather
than starting a second one (the example service in `examples/` does). The reply body is the
agent's report: `{"reward"?, "answer"?, "metadata"?}`.

What a reply means: 2xx is the agent's report; 502/503/504 or no connection, the service (or
what fronts it) is unavailable, so the same attempt is POSTed again; 410 Gone, the service
lost the attempt (it restarted while the attempt ran): an infra failure, and the rollout gets
a fresh attempt rather than the same attempt run twice; any other status is the agent's
failure (unless DARL's gateway failed it first, which the rollout workflow learns at close).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass

import aiohttp
from pydantic import ValidationError

from darl.activities.agent_contract import AgentContract, env_map_values
from darl.activities.errors import agent_lost_error, agent_service_unavailable, agent_spec_error
from darl.activities.http import http_session
from darl.activities.runners.base import (
    LOG_TAIL_BYTES,
    AgentRunner,
    agent_deadline,
    agent_heartbeat_interval,
)
from darl.workflows.contracts import (
    AgentExit,
    AgentHandle,
    AgentReport,
    AwaitRequest,
    HttpAgentSpec,
    LaunchRequest,
)
from darl.workflows.heartbeats import Heartbeat

# The POST lasts as long as the agent runs: no read or total timeout (the runner keeps the
# rollout's deadline itself), whatever the session's default (a 60 s read timeout would end
# every longer attempt with a retry that POSTs it again).
AGENT_POST_TIMEOUT = aiohttp.ClientTimeout(total=None, sock_connect=10.0)
# Statuses that say the service (or what fronts it) is unavailable, not that the agent failed.
_UNAVAILABLE = frozenset({502, 503, 504})
# The service accepted the attempt and lost it (it restarted): never run it again.
_LOST = 410
REPORT_FIELDS = ("reward", "answer", "metadata")


# How long an idle connection to an agent service is kept: under the 5 s of common servers
# (uvicorn's default), so the worker closes it first and never POSTs an attempt on a
# connection the service is closing. DARL's own servers keep theirs 75 s (deploy/serving.py).
AGENT_KEEP_ALIVE_SECONDS = 4.0


@dataclass(frozen=True)
class _Reply:
    status: int
    content: bytes

    @property
    def text(self) -> str:
        return self.content.decode(errors="replace")


class HttpAgentRunner(AgentRunner):
    kind = "http"

    def __init__(
        self,
        session: aiohttp.ClientSession | None = None,
        max_attempts: int = 256,
        traced: bool = True,
    ) -> None:
        """`session` is borrowed (not closed here); without one the runner keeps a pool of its
        own (`traced` as `http_session` says) with room for `max_attempts` attempts at once,
        each holding a connection for as long as its agent runs (aiohttp's default pool of 100
        would queue the rest)."""
        self._owns_session = session is None
        self.session = session or http_session(max_attempts, AGENT_KEEP_ALIVE_SECONDS, traced)

    async def launch(self, request: LaunchRequest, contract: AgentContract) -> AgentHandle:
        agent = request.spec.agent
        if not isinstance(agent, HttpAgentSpec):
            raise agent_spec_error(f"the http runner cannot run a {agent.kind!r} agent")
        # Nothing starts until the POST in wait(): launching is free and trivially idempotent.
        return AgentHandle(
            kind=self.kind,
            rollout_id=request.spec.rollout_id,
            attempt=request.attempt,
            started_at=time.time(),
            data={"url": agent.url},
        )

    async def wait(
        self, request: AwaitRequest, contract: AgentContract, heartbeat: Heartbeat
    ) -> AgentExit:
        spec = request.spec
        agent = spec.agent
        if not isinstance(agent, HttpAgentSpec):
            raise agent_spec_error(f"the http runner cannot run a {agent.kind!r} agent")
        deadline = agent_deadline(request)
        body = {
            "rollout_id": spec.rollout_id,
            "attempt": request.attempt,
            "run_id": spec.run_id,
            "group_id": spec.group_id,
            "mode": spec.mode.value,
            "task": spec.task,
            "env": env_map_values(spec.task, agent.env_map),
            "openai_base_url": contract.base_url,
            "anthropic_base_url": contract.anthropic_base_url,
            "api_key": contract.token,
            "result_url": contract.result_url,
            "traceparent": contract.traceparent,
            "deadline": deadline,
        }
        headers = {**agent.headers, "Idempotency-Key": f"{spec.rollout_id}/{request.attempt}"}
        if contract.traceparent:
            headers["traceparent"] = contract.traceparent
        post = asyncio.ensure_future(self._post(agent.url, body, headers))
        interval = agent_heartbeat_interval(spec.timeouts.heartbeat_seconds)
        try:
            # The first heartbeat comes an interval in, not at once: the SDK sends the first
            # one to the server straight away, and most POSTs are answered sooner.
            while not post.done():
                remaining = deadline - time.time()
                if remaining <= 0:
                    return AgentExit(exit_code=None, timed_out=True)
                await asyncio.wait({post}, timeout=min(interval, remaining))
                if not post.done():
                    heartbeat({"url": agent.url})
            response = post.result()
        except (aiohttp.ClientError, TimeoutError) as err:
            raise agent_service_unavailable(f"agent service {agent.url}: {err!r}") from err
        finally:
            if not post.done():
                post.cancel()
                with contextlib.suppress(asyncio.CancelledError, aiohttp.ClientError):
                    await post
        return self._exit_from(response)

    async def _post(self, url: str, body: dict[str, object], headers: dict[str, str]) -> _Reply:
        async with self.session.post(
            url, json=body, headers=headers, timeout=AGENT_POST_TIMEOUT
        ) as response:
            return _Reply(response.status, await response.read())

    async def kill(self, handle: AgentHandle) -> None:
        # Cancelling wait() closes the connection; the service sees the client go away.
        return None

    async def stop(self, request: LaunchRequest) -> None:
        # Nothing starts before wait() POSTs, and a cancelled rollout never gets there.
        return None

    async def aclose(self) -> None:
        if self._owns_session:
            await self.session.close()

    @staticmethod
    def _exit_from(response: _Reply) -> AgentExit:
        text = response.text[-LOG_TAIL_BYTES:]
        if response.status in _UNAVAILABLE:
            raise agent_service_unavailable(
                f"agent service answered {response.status}: {text[-500:]}"
            )
        if response.status == _LOST:
            raise agent_lost_error(f"the agent service lost the attempt: {text[-500:]}")
        if response.status >= 400:
            return AgentExit(exit_code=1, log_tail=f"HTTP {response.status}: {text}")
        try:
            reply = json.loads(response.content) if response.content else {}
            if not isinstance(reply, dict):
                raise ValueError("the reply is not a JSON object")
            report = AgentReport.model_validate({k: reply[k] for k in REPORT_FIELDS if k in reply})
        except (ValueError, ValidationError) as err:
            return AgentExit(exit_code=1, log_tail=f"agent service reply is not a report: {err}")
        too_large = report.over_budget()
        if too_large is not None:
            return AgentExit(exit_code=1, log_tail=f"agent service reply refused: {too_large}")
        return AgentExit(exit_code=0, report=report, log_tail=text)
