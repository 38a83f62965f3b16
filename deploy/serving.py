"""Serving an ASGI app on 127.0.0.1 (or a given host) with uvicorn, under DARL's own signal
handling, and announcing the bound address in a ready file once it accepts connections."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import socket
from collections.abc import Callable, Generator
from pathlib import Path
from typing import Any

import uvicorn

from darl.files import write_ready_file


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        # The process's entrypoint owns SIGINT/SIGTERM and sets `should_exit`.
        yield


def freeze_built_heap() -> None:
    """Keep everything a server or worker imported and built at start-up, which lives as long
    as the process, out of the collector's full passes: each pass over it stalls the gateway's
    event loop 50-75 ms under load, a rollout worker's 84-106 ms several times a minute, and a
    trainer worker's 318 ms. What is garbage already is collected first rather than kept for
    good."""
    gc.collect()
    gc.freeze()


def bind(host: str, port: int) -> socket.socket:
    """Bind before serving, so port 0 gives a free port with no probing race."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # Inherited by accepted connections: without it, a response written as headers then body
    # waits ~40 ms for the client's delayed ACK (Nagle), on every call.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.setblocking(False)
    return sock


# How long a server keeps an idle connection open: longer than any client's idle expiry (httpx
# and the OpenAI SDK 5 s, the gateway's aiohttp pool 30 s), so the client always closes an idle
# connection first. With uvicorn's default 5 s both ends can close at once, and an agent that
# reuses the connection then gets a ReadError from a gateway that never saw its call.
KEEP_ALIVE_SECONDS = 75


async def serve_app(
    app: Any,
    host: str,
    port: int,
    stop: asyncio.Event,
    ready_file: Path | None = None,
    name: str = "server",
    graceful_seconds: float = 5.0,
    on_stop: Callable[[], None] | None = None,
) -> None:
    """Serve until `stop` is set. Then: `on_stop`, no new connections, requests in flight
    get `graceful_seconds` to finish, the app's lifespan ends."""
    sock = bind(host, port)
    actual_port = sock.getsockname()[1]
    config = uvicorn.Config(
        app,
        lifespan="on",
        log_level="warning",
        access_log=False,
        # Annotated int; uvicorn waits on it with asyncio.wait_for, which takes seconds as float.
        timeout_graceful_shutdown=graceful_seconds,  # type: ignore[arg-type]
        timeout_keep_alive=KEEP_ALIVE_SECONDS,
    )
    server = _Server(config)
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    # uvicorn offers a `started` flag, not an event.
    while not server.started and not serving.done():  # noqa: ASYNC110
        await asyncio.sleep(0.02)
    if serving.done():
        await serving
        raise RuntimeError(f"{name} failed to start")
    freeze_built_heap()
    url = f"http://{host}:{actual_port}"
    if ready_file is not None:
        write_ready_file(ready_file, {"url": url, "name": name})
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait({serving, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if on_stop is not None:
        on_stop()
    server.should_exit = True
    stopping.cancel()
    await serving
    sock.close()
