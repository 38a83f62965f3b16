"""Watching a local process from the event loop: waiting for its exit without polling (a
pidfd), and reading the end of the file it writes its log to."""

from __future__ import annotations

import asyncio
import contextlib
import os
from pathlib import Path


async def wait_for_exit(pid: int, timeout: float) -> None:
    """Return when `pid` exits or after `timeout`, without polling (a pidfd on the loop)."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    loop = asyncio.get_running_loop()
    exited: asyncio.Future[None] = loop.create_future()

    def readable() -> None:
        if not exited.done():
            exited.set_result(None)

    loop.add_reader(pidfd, readable)
    try:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(exited, timeout)
    finally:
        loop.remove_reader(pidfd)
        os.close(pidfd)


def file_tail(path: Path, size: int) -> str:
    """The last `size` bytes of the file as text ("" when there is no file yet)."""
    try:
        with path.open("rb") as f:
            f.seek(max(0, path.stat().st_size - size))
            return f.read().decode("utf-8", errors="replace")
    except FileNotFoundError:
        return ""
