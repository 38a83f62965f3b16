"""What a policy server says about the model it serves: its name and context length (its
`/v1/models` listing, cached per server) and a prompt's token ids (its `/tokenize`); with
them, the size of a prompt it refused as over its context."""

from __future__ import annotations

import logging
import time
from typing import Any

import aiohttp

from darl.gateway.calls.forwarding import Forwarder
from darl.gateway.calls.model_call import ModelCall
from darl.gateway.calls.traffic import UpstreamPool
from darl.gateway.errors import APIError, UpstreamError, UpstreamUnreachableError
from darl.gateway.protocols.chat.protocol import CHAT, TEMPLATE_FIELDS, Endpoint
from darl.gateway.protocols.overflow import PromptSize
from darl.gateway.protocols.translation import upstream_error_message
from darl.workflows.rollout_token import TokenClaims

log = logging.getLogger(__name__)


class UpstreamModels:
    def __init__(
        self,
        *,
        forwarder: Forwarder,
        pool: UpstreamPool,
        model: str | None,
        call_deadline_seconds: float,
    ) -> None:
        self.forwarder = forwarder
        self.pool = pool
        # The model name every call names (None: the one each policy server lists first).
        self.model = model
        self.call_deadline_seconds = call_deadline_seconds
        self._models: dict[str, str] = {}
        self._context_lengths: dict[tuple[str, str], int] = {}

    async def model_for(self, upstream: str) -> str:
        """The configured model name, else the first model the upstream lists."""
        if self.model:
            return self.model
        if upstream not in self._models:
            try:
                listing = await self.forwarder.get_json(f"{upstream}/v1/models")
                self._models[upstream] = listing["data"][0]["id"]
            except (
                aiohttp.ClientError,
                TimeoutError,
                KeyError,
                IndexError,
                TypeError,
                ValueError,
            ) as err:
                raise UpstreamUnreachableError(
                    f"cannot list the models of policy server {upstream}: {err!r}"
                ) from err
        return self._models[upstream]

    async def models(self) -> list[str]:
        return sorted({await self.model_for(u) for u in self.pool.urls})

    async def count_prompt_tokens(self, claims: TokenClaims, chat: dict[str, Any]) -> int:
        """The prompt tokens of a chat request as the rollout's policy server renders it."""
        return len(await self.prompt_ids(claims, CHAT, chat))

    async def prompt_ids(
        self, claims: TokenClaims, endpoint: Endpoint, request: dict[str, Any]
    ) -> list[int]:
        """The prompt's token ids of a chat or text completion request as the rollout's policy
        server renders it (its `/tokenize`, vLLM's shape); nothing is generated or recorded."""
        upstream = self.pool.pick(claims.rollout_id)
        body: dict[str, Any] = {"model": await self.model_for(upstream)}
        if endpoint == CHAT:
            body.update(messages=request["messages"], add_generation_prompt=True)
            # What else renders the prompt, as the chat request had it (vLLM's names).
            for key in TEMPLATE_FIELDS:
                if request.get(key) is not None:
                    body[key] = request[key]
        elif isinstance(request["prompt"], list):
            return list(request["prompt"])
        else:
            body["prompt"] = request["prompt"]
        deadline = time.monotonic() + min(60.0, self.call_deadline_seconds)
        reply = await self.forwarder.send(f"{upstream}/tokenize", body, deadline, stream=False)
        if reply.status != 200:
            status = reply.status if reply.status < 500 else 502
            raise UpstreamError(upstream_error_message(reply.body), status=status)
        try:
            return [int(t) for t in reply.json()["tokens"]]
        except (ValueError, KeyError, TypeError) as err:
            raise UpstreamError(f"policy server {upstream} cannot count tokens") from err

    async def context_length(self, upstream: str, model: str) -> int:
        """The context of `model` at `upstream`: the `max_model_len` its model listing says
        (vLLM's and the reference server's)."""
        if (upstream, model) not in self._context_lengths:
            try:
                listing = await self.forwarder.get_json(f"{upstream}/v1/models")
                cards = {card["id"]: card for card in listing["data"]}
                card = cards.get(model) or listing["data"][0]
                self._context_lengths[upstream, model] = int(card["max_model_len"])
            except (aiohttp.ClientError, TimeoutError, KeyError, IndexError, TypeError) as err:
                raise UpstreamError(
                    f"policy server {upstream} does not list the context of {model!r}: {err!r}"
                ) from err
        return self._context_lengths[upstream, model]

    async def prompt_size(self, call: ModelCall) -> PromptSize | None:
        """The refused prompt's tokens and the context it did not fit, as the policy server
        counts them; None (logged) when it cannot say: the agent then gets its words."""
        try:
            prompt = await self.prompt_ids(call.claims, call.endpoint, call.forwarded)
            context = await self.context_length(call.upstream, str(call.forwarded["model"]))
        except APIError as err:
            log.warning("cannot measure the prompt of an overflow: %s", err.message)
            return None
        budget = call.forwarded.get("max_completion_tokens") or call.forwarded.get("max_tokens")
        return PromptSize(len(prompt), context, budget if isinstance(budget, int) else None)
