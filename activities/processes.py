"""Watching a local process from the event loop: waiting for its exit without polling (a
pidfd), and reading the files it may have touched (its log, its exit status) without a link
followed or a wait."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import stat
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


# How a file an agent could have replaced is opened: never through a link, never waiting
# (a FIFO would hold an open until a writer came, and with it the worker's event loop).
_SAFE_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class NotARegularFileError(OSError):
    """A path that should hold a file holds something else (a FIFO, a link, a device)."""


def read_file(path: Path, limit: int = 1 << 20, tail: bool = False) -> bytes:
    """At most `limit` bytes of the regular file at `path` (its last ones with `tail`),
    opened without following a link or blocking: a file an agent could have replaced can
    never hold the reader. Raises FileNotFoundError, NotARegularFileError, OSError."""
    try:
        fd = os.open(path, _SAFE_READ)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise NotARegularFileError(err.errno, f"{path} is a link") from None
        raise
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotARegularFileError(errno.EINVAL, f"{path} is not a regular file")
        if tail:
            f.seek(max(0, st.st_size - limit))
        return f.read(limit)


def file_tail(path: Path, size: int) -> str:
    """The last `size` bytes of the file as text ("" when there is no regular file there)."""
    try:
        return read_file(path, size, tail=True).decode("utf-8", errors="replace")
    except (FileNotFoundError, NotARegularFileError):
        return ""


class PipeReader:
    """The read end of a pipe, read on the event loop as it fills (never a thread blocked on
    it, never a file object that could close the descriptor a second time): its first `cap`
    bytes. It owns the descriptor: `close` closes it, once."""

    def __init__(self, fd: int, cap: int) -> None:
        self._fd, self._cap = fd, cap
        self._chunks: list[bytes] = []
        self._size = 0
        os.set_blocking(fd, False)
        self._loop = asyncio.get_running_loop()
        self._ended: asyncio.Future[None] = self._loop.create_future()
        self._loop.add_reader(fd, self._readable)

    def _readable(self) -> None:
        try:
            while chunk := os.read(self._fd, 1 << 16):
                if self._size < self._cap:
                    self._chunks.append(chunk[: self._cap - self._size])
                self._size += len(chunk)
        except BlockingIOError:
            return  # all there is for now
        except OSError as err:
            if not self._ended.done():
                self._ended.set_exception(err)
            self._loop.remove_reader(self._fd)
            return
        if not self._ended.done():  # every writer has closed its end
            self._ended.set_result(None)
        self._loop.remove_reader(self._fd)

    async def read(self, timeout: float) -> tuple[bytes, bool]:
        """What the pipe held, once every writer has closed its end (or `timeout` has passed:
        then what came so far), and whether that was not all: past `cap`, or not ended."""
        try:
            await asyncio.wait_for(asyncio.shield(self._ended), timeout)
        except TimeoutError:
            return b"".join(self._chunks), True
        finally:
            self.close()
        return b"".join(self._chunks), self._size > self._cap

    def close(self) -> None:
        if self._fd >= 0:
            self._loop.remove_reader(self._fd)
            os.close(self._fd)
            self._fd = -1
