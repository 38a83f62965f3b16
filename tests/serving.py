"""Serving an app in the test's own event loop on a kernel-chosen loopback port (real uvicorn,
so streams stream), for tests that need DARL components in process."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from darl.deploy.serving import serve_app


@contextlib.asynccontextmanager
async def served(app: Any, tmp: Path, name: str) -> AsyncIterator[str]:
    """Yields the app's base URL; stops the server on exit."""
    stop = asyncio.Event()
    ready = tmp / f"{name}.ready.json"
    serving = asyncio.create_task(serve_app(app, "127.0.0.1", 0, stop, ready, name))
    async with asyncio.timeout(30):
        while not ready.exists():
            if serving.done():
                await serving  # raises the reason it could not start
            await asyncio.sleep(0.02)
    try:
        yield json.loads(ready.read_text())["url"]
    finally:
        stop.set()
        await serving
