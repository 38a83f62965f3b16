"""Forwarding a call to its policy server: retries of 408/409/429/5xx and transport errors with
jittered exponential backoff, all under the call's overall deadline."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass
from typing import Any

import httpx

from gateway.errors import GatewayError

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
        delay = min(self.backoff_base_seconds * 2**retry, self.backoff_cap_seconds)
        delay *= rng.uniform(0.75, 1.25)
        return max(delay, min(hint, self.backoff_cap_seconds)) if hint else delay


@dataclass
class UpstreamReply:
    response: httpx.Response
    retries: int


def _retry_after(response: httpx.Response) -> float | None:
    try:
        return float(response.headers["retry-after"])
    except (KeyError, ValueError):
        return None


class Forwarder:
    def __init__(
        self,
        client: httpx.AsyncClient,
        retry: RetrySettings,
        api_key: str | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self._client = client
        self._retry = retry
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._rng = rng or random.Random()

    async def send(
        self, url: str, body: dict[str, Any], deadline: float, stream: bool
    ) -> UpstreamReply:
        """POST `body` to `url` until an answer that is not worth retrying, the last attempt,
        or the deadline (time.monotonic()). With `stream`, the reply's body is left open for
        the caller to read and close. Raises GatewayError 502/504 when nothing usable came."""
        failure: GatewayError | None = None
        for attempt in range(self._retry.max_attempts):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            timeout = min(self._retry.attempt_timeout_seconds, remaining)
            hint = None
            try:
                response = await self._attempt(url, body, timeout, stream)
            except httpx.TimeoutException as err:
                failure = GatewayError(
                    504,
                    f"policy server {url} timed out: {err!r}",
                    type="server_error",
                    code="upstream_timeout",
                )
            except httpx.TransportError as err:
                failure = GatewayError(
                    502,
                    f"policy server {url} unreachable: {err!r}",
                    type="server_error",
                    code="upstream_unreachable",
                )
            else:
                last = attempt == self._retry.max_attempts - 1
                if response.status_code not in RETRY_STATUSES or last:
                    return UpstreamReply(response, attempt)
                hint = _retry_after(response)
                await response.aclose()
                failure = GatewayError(
                    502,
                    f"policy server {url} answered {response.status_code}",
                    type="server_error",
                    code="upstream_error",
                )
            if attempt < self._retry.max_attempts - 1:
                delay = self._retry.backoff(attempt, self._rng, hint)
                log.info("retrying %s in %.2fs: %s", url, delay, failure.message if failure else "")
                await asyncio.sleep(min(delay, max(0.0, deadline - time.monotonic())))
        raise failure or GatewayError(
            504,
            "the call's deadline passed before the policy server answered",
            type="server_error",
            code="upstream_timeout",
        )

    async def _attempt(
        self, url: str, body: dict[str, Any], timeout: float, stream: bool
    ) -> httpx.Response:
        request = self._client.build_request(
            "POST",
            url,
            json=body,
            headers=self._headers,
            timeout=httpx.Timeout(timeout, connect=min(10.0, timeout)),
        )
        if stream:
            return await self._client.send(request, stream=True)
        try:
            async with asyncio.timeout(timeout):
                return await self._client.send(request)
        except TimeoutError as err:
            raise httpx.ReadTimeout(f"no answer within {timeout:g}s", request=request) from err

    async def get_json(self, url: str, timeout: float = 10.0) -> Any:
        response = await self._client.get(url, headers=self._headers, timeout=timeout)
        response.raise_for_status()
        return response.json()
