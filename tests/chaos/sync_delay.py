"""A fault injector on the weight-sync path, named as one (it is not a policy server): the
trainer's calls to the policy server's control API go through it, and while it is armed it
holds `/reload_weights` for a few seconds. That is the window in which the chaos harness
kills the trainer worker inside `sync_weights`, or the gateway while it is paused for a sync
(a real sync of the tiny model takes ~30 ms, too short to aim at)."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import Response


class SyncDelay:
    def __init__(self, target: str, hold_seconds: float = 4.0) -> None:
        self.target = target.rstrip("/")
        self.hold_seconds = hold_seconds
        self.armed = False
        # Set while a reload is held: the harness strikes then.
        self.holding = asyncio.Event()
        self.client = httpx.AsyncClient(timeout=120)

    def arm(self) -> None:
        """Hold the next reload (once)."""
        self.armed = True
        self.holding.clear()

    async def forward(self, request: Request, path: str) -> Response:
        # Read first: the caller may be killed while the reload is held.
        body = await request.body()
        if path == "reload_weights" and self.armed:
            self.armed = False
            self.holding.set()
            try:
                await asyncio.sleep(self.hold_seconds)
            finally:
                self.holding.clear()
        try:
            upstream = await self.client.request(
                request.method,
                f"{self.target}/{path}",
                params=request.query_params,
                content=body,
                headers={"content-type": request.headers.get("content-type", "application/json")},
            )
        except httpx.TransportError as error:
            # The policy server behind it is down (the harness killed it): answer as a proxy
            # does, so the caller sees the policy server unreachable.
            return Response(f"policy server unreachable: {error!r}", 502)
        return Response(
            upstream.content,
            upstream.status_code,
            media_type=upstream.headers.get("content-type"),
        )

    def app(self) -> Any:
        api = FastAPI(title="weight-sync fault injector")

        @api.api_route("/{path:path}", methods=["GET", "POST", "PUT"])
        async def anything(request: Request, path: str) -> Response:
            return await self.forward(request, path)

        return api
