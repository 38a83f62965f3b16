"""What a live call's whole and streamed answers share (`UpstreamExchange`): asking the call's
policy server whatever the agent does meanwhile, proving which weights answered (rule 8: an
answer from weights behind the run's version is never recorded, see `versions`), waiting for a
policy server that serves older weights, and passing on a refusal, recorded as a failed call.
"""

from __future__ import annotations

import json
import time

import aiohttp
from fastapi.responses import Response

from darl.gateway.calls.forwarding import Forwarder, UpstreamReply
from darl.gateway.calls.model_call import ModelCall, to_the_end, unless_disconnected
from darl.gateway.calls.recording import CallRecorder
from darl.gateway.calls.traffic import PauseGate
from darl.gateway.calls.upstream_models import UpstreamModels
from darl.gateway.calls.versions import UpstreamVersions
from darl.gateway.errors import BadRequestError, UpstreamError, UpstreamVersionUnreadableError
from darl.gateway.metrics import GatewayMetrics
from darl.gateway.protocols.overflow import context_length_exceeded, is_context_overflow
from darl.gateway.protocols.translation import upstream_error_message


class UpstreamExchange:
    def __init__(
        self,
        *,
        forwarder: Forwarder,
        gate: PauseGate,
        versions: UpstreamVersions,
        upstream_models: UpstreamModels,
        recorder: CallRecorder,
        metrics: GatewayMetrics,
        stale_wait_seconds: float,
    ) -> None:
        self.forwarder = forwarder
        self.gate = gate
        self.versions = versions
        self.upstream_models = upstream_models
        self.recorder = recorder
        self.metrics = metrics
        self.stale_wait_seconds = stale_wait_seconds

    async def send(self, call: ModelCall, stream: bool) -> UpstreamReply:
        """The policy server's reply, whatever the agent does meanwhile (`to_the_end`): an
        agent that left makes the call's answer unreceived."""
        reply, left = await to_the_end(
            call.request,
            self.forwarder.send(
                call.url,
                call.forwarded,
                call.deadline,
                stream,
                headers={"X-Darl-Call-Id": call.call_id},
            ),
        )
        call.unreceived = call.unreceived or left
        call.retries = reply.retries
        return reply

    async def refused(
        self, call: ModelCall, status: int, body: bytes, content_type: str
    ) -> Response:
        """The policy server's error answer (after retries): recorded as a failed call, and
        passed on to the agent, in its protocol's shape; a prompt over the context as the
        agent's API says it (raised: the proxy records it)."""
        message = upstream_error_message(body)
        if is_context_overflow(status, body):
            size = await self.upstream_models.prompt_size(call)
            raise context_length_exceeded(call.protocol, size, message)
        await self.recorder.failed(call.claims, call.protocol, call, call.started, status, message)
        if call.translation is None:
            return Response(body, status, media_type=content_type)
        code = (UpstreamError if status >= 500 else BadRequestError).code
        shaped = call.translation.error_body(status, message, code)
        return Response(json.dumps(shaped), status, media_type="application/json")

    # --- which weights answered ----------------------------------------------------------

    async def version_after(self, call: ModelCall, arrived: float) -> int | None:
        """The version the upstream reports when asked after the answer arrived, asked
        whatever the agent does: an answer is recorded, received or not, with its version."""
        try:
            return await self.versions.version_after(call.upstream, arrived)
        except (aiohttp.ClientError, TimeoutError) as err:
            raise UpstreamVersionUnreadableError(
                f"cannot read the policy version of policy server {call.upstream}: {err!r}"
            ) from err

    def behind(self, call: ModelCall) -> bool:
        """Whether the answer came from weights older than the version the call was admitted
        under (a policy server that restarted on older weights): it must not be recorded."""
        return self.versions.note(
            call.upstream, call.served_version, call.admitted().policy_version
        )

    async def until_upstream_current(self, call: ModelCall) -> None:
        """Wait (`stale_wait_seconds` at most, within the call's deadline) while the call's
        policy server is known to serve older weights than the run's."""
        if call.upstream in self.versions.stale:
            seconds = max(0.0, min(self.stale_wait_seconds, call.time_left()))
            await unless_disconnected(
                call.request,
                self.versions.wait_until_current(call.upstream, self.gate.policy_version, seconds),
            )

    def upstream_done(self, call: ModelCall) -> float:
        """Milliseconds from admission to the policy server's full answer (retries included)."""
        latency = time.monotonic() - call.started
        self.metrics.upstream_seconds.observe(latency)
        self.metrics.upstream_retries.inc(call.retries)
        return latency * 1000
