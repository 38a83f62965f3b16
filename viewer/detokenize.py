"""The text of token ids as the policy server that served a call decodes them: its
`/detokenize` (vLLM's and the reference server's), one id a request, remembered per server.
A server that cannot be reached gives nothing: the viewer then shows what it can prove."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

import httpx

log = logging.getLogger(__name__)

# The most ids a page asks a server about that it has not answered before, and at once.
MOST_NEW_IDS = 4096
AT_ONCE = 16


class ServerDetokenizer:
    """The token texts policy servers gave, by server URL and id."""

    def __init__(self, timeout_seconds: float = 5.0) -> None:
        self._timeout = timeout_seconds
        self._known: dict[str, dict[int, str]] = {}

    async def texts(self, upstream: str, ids: Iterable[int]) -> dict[int, str]:
        """The text of each id the server at `upstream` decodes (those it was asked before,
        and up to MOST_NEW_IDS more); empty when it cannot be reached."""
        known = self._known.setdefault(upstream, {})
        missing = sorted(set(ids) - set(known))[:MOST_NEW_IDS]
        if missing:
            try:
                async with httpx.AsyncClient(base_url=upstream, timeout=self._timeout) as http:
                    limit = asyncio.Semaphore(AT_ONCE)

                    async def one(token_id: int) -> None:
                        async with limit:
                            answer = await http.post("/detokenize", json={"tokens": [token_id]})
                        answer.raise_for_status()
                        known[token_id] = str(answer.json()["prompt"])

                    await asyncio.gather(*(one(i) for i in missing))
            except (httpx.HTTPError, ValueError, KeyError, TypeError) as err:
                log.info("policy server %s cannot detokenize (%r): ids shown as ids", upstream, err)
                return {}
        return dict(known)
