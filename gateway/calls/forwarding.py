"""Forwarding a call to its policy server: retries of 408/409/429/5xx and transport errors with
jittered exponential backoff, all under the call's overall deadline.

aiohttp, not httpx, on this hot path: under 32 concurrent calls httpx's connection pool spent a
quarter of the gateway's CPU checking idle sockets (measured with py-spy, `make bench`).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp

from darl.gateway import json_codec
from darl.gateway.errors import (
    APIError,
    UpstreamError,
    UpstreamTimeoutError,
    UpstreamUnreachableError,
)
from darl.gateway.tracing import client_tracing

log = logging.getLogger(__name__)

RETRY_STATUSES = frozenset({408, 409, 429, *range(500, 600)})


@dataclass(frozen=True)
class RetrySettings:
    max_attempts: int = 6
    backoff_base_seconds: float = 0.5
    backoff_cap_seconds: float = 8.0
    attempt_timeout_seconds: float = 300.0

    def backoff(self, retry: int, rng: random.Random, hint: float | None = None) -> float:
        """min(base * 2^retry, cap) x U(0.75, 1.25), or the upstream's Retry-After if longer."""
        delay = min(self.backoff_base_seconds * 2.0**retry, self.backoff_cap_seconds)
        delay *= rng.uniform(0.75, 1.25)
        return max(delay, min(hint, self.backoff_cap_seconds)) if hint else delay


@dataclass
class UpstreamReply:
    """The policy server's answer: whole (`body`) or, for streams, still open (`chunks`)."""

    status: int
    headers: Mapping[str, str]
    retries: int
    body: bytes = b""
    _response: aiohttp.ClientResponse | None = None

    @property
    def content_type(self) -> str:
        return self.headers.get("Content-Type", "application/json")

    def json(self) -> Any:
        return json_codec.loads(self.body)

    async def chunks(self) -> AsyncIterator[bytes]:
        if self._response is not None:
            async for chunk in self._response.content.iter_any():
                yield chunk

    async def read(self) -> bytes:
        if self._response is not None:
            self.body = await self._response.read()
        return self.body

    async def aclose(self) -> None:
        if self._response is not None:
            self._response.release()


def _retry_after(headers: Mapping[str, str]) -> float | None:
    try:
        return float(headers["Retry-After"])
    except (KeyError, ValueError):
        return None


class Forwarder:
    """Owns the gateway's pooled connections to the policy servers (`start` / `aclose`)."""

    def __init__(
        self,
        retry: RetrySettings,
        api_key: str | None = None,
        rng: random.Random | None = None,
        traced: bool = True,
    ) -> None:
        self._retry = retry
        self._traced = traced
        self._headers = {"Content-Type": "application/json"}
        if api_key:
            self._headers["Authorization"] = f"Bearer {api_key}"
        self._rng = rng or random.Random()
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=1024, limit_per_host=0, keepalive_timeout=30),
            # Untraced, a call carries the agent's call's context (made current by
            # `HandedOnContext`) as it came.
            **client_tracing(self._traced),
        )

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("the forwarder is not started")
        return self._session

    async def send(
        self,
        url: str,
        body: dict[str, Any],
        deadline: float,
        stream: bool,
        headers: Mapping[str, str] | None = None,
    ) -> UpstreamReply:
        """POST `body` to `url` until an answer that is not worth retrying, the last attempt,
        or the deadline (time.monotonic()). With `stream`, the reply is left open for the
        caller to read and close. Raises APIError 502/504 when nothing usable came."""
        payload = json_codec.dumps(body)
        sent_headers = {**self._headers, **headers} if headers else self._headers
        failure: APIError | None = None
        for attempt in range(self._retry.max_attempts):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            timeout = min(self._retry.attempt_timeout_seconds, remaining)
            hint = None
            try:
                reply = await self._attempt(url, payload, sent_headers, timeout, stream, attempt)
            except TimeoutError as err:
                failure = UpstreamTimeoutError(f"policy server {url} timed out after {timeout:g}s")
                failure.__cause__ = err
            except aiohttp.ClientError as err:
                failure = UpstreamUnreachableError(f"policy server {url} unreachable: {err!r}")
            else:
                last = attempt == self._retry.max_attempts - 1
                if reply.status not in RETRY_STATUSES or last:
                    return reply
                hint = _retry_after(reply.headers)
                await reply.aclose()
                failure = UpstreamError(f"policy server {url} answered {reply.status}")
            if attempt < self._retry.max_attempts - 1:
                delay = self._retry.backoff(attempt, self._rng, hint)
                log.info("retrying %s in %.2fs: %s", url, delay, failure.message)
                await asyncio.sleep(min(delay, max(0.0, deadline - time.monotonic())))
        raise failure or UpstreamTimeoutError(
            "the call's deadline passed before the policy server answered"
        )

    async def _attempt(
        self,
        url: str,
        payload: bytes,
        headers: Mapping[str, str],
        timeout: float,
        stream: bool,
        retries: int,
    ) -> UpstreamReply:
        connect = min(10.0, timeout)
        if stream:
            client_timeout = aiohttp.ClientTimeout(sock_connect=connect, sock_read=timeout)
        else:
            client_timeout = aiohttp.ClientTimeout(total=timeout, sock_connect=connect)
        response = await self.session.post(
            url, data=payload, headers=headers, timeout=client_timeout
        )
        reply = UpstreamReply(response.status, response.headers, retries, _response=response)
        if stream:
            return reply
        try:
            reply.body = await response.read()
        finally:
            response.release()
        reply._response = None
        return reply

    async def get_json(self, url: str, timeout: float = 10.0) -> Any:
        async with self.session.get(
            url,
            headers=self._headers,
            timeout=aiohttp.ClientTimeout(total=timeout),
        ) as response:
            response.raise_for_status()
            return await response.json()
