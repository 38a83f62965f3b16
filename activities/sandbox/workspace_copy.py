"""The grader's copy of what an agent left in its workspace (and its removal), made so that
nothing the agent or its tests left can stall, fool or overwhelm it: every directory and
file is opened relative to its parent's descriptor without following links and without
blocking (a FIFO, a socket or a device is left out, never opened), a file is copied only as
far as its size said, each file is copied once however many links it has (the others are
linked to the copy), and a workspace over its limits (`SandboxLimits`: bytes, entries, path
length) is refused as the agent's outcome (`UngradableWorkspaceError`) before anything is
written. `remove_tree` removes a tree however deep or long its paths (the tests may have made
any).

Synchronous, for a thread.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from darl.activities.sandbox.errors import UngradableWorkspaceError
from darl.workflows.contracts import SandboxLimits

# A path in the copy longer than this (bytes, relative to the copy) is refused: the grader's
# own steps (git, pytest) name files by path, and Linux refuses paths of PATH_MAX (4096).
MAX_PATH_BYTES = 3000
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_DIRECTORY = _READ | os.O_DIRECTORY
CHUNK = 1 << 20


@dataclass
class CopyReport:
    """What the copy left out (a FIFO, a socket, a device, what could not be read), and
    its size: entries and bytes (each file once)."""

    left_out: list[str] = field(default_factory=list)
    entries: int = 0
    bytes: int = 0


def copy_workspace(source: Path, target: Path, limits: SandboxLimits) -> CopyReport:
    """Copy the workspace at `source` to `target` (made here): regular files (content and
    mode bits), links as links, directories made writable. Raises UngradableWorkspaceError
    when the workspace is over its limits, before a byte of it is written: an agent that
    filled the disk the copy goes to is refused for its size, never failed by the disk."""
    root = os.open(source, _DIRECTORY)
    try:
        _Walk(limits).tree(root)
        copier = _Copier(limits, target)
        copier.tree(root)
    finally:
        os.close(root)
    return copier.report


class _Walk:
    """A walk of a workspace that measures it against its limits (raising
    UngradableWorkspaceError), writing nothing."""

    def __init__(self, limits: SandboxLimits) -> None:
        self._max_bytes = limits.workspace_mb * 1024 * 1024
        self._max_entries = limits.workspace_files
        self._seen: set[tuple[int, int]] = set()
        self.report = CopyReport()

    def tree(self, root: int) -> None:
        """Walk the directory open as `root` with descriptors: each directory is opened from
        the root a name at a time, so no path of any length is resolved and no more than one
        directory is held open."""
        pending: list[str] = [""]
        while pending:
            rel = pending.pop()
            dir_fd = _open_dir(root, rel)
            if dir_fd is None:
                self.report.left_out.append(rel)
                continue
            try:
                for name, st in _entries(dir_fd):
                    path = f"{rel}/{name}" if rel else name
                    self._count(path)
                    if stat.S_ISDIR(st.st_mode):
                        self.directory(path)
                        pending.append(path)
                    elif stat.S_ISLNK(st.st_mode):
                        self.link(dir_fd, name, path)
                    elif stat.S_ISREG(st.st_mode):
                        key = (st.st_dev, st.st_ino)
                        if st.st_nlink > 1 and key in self._seen:
                            self.linked(key, path)
                            continue
                        self._measure(path, st)
                        self.file(dir_fd, name, path, st)
                        if st.st_nlink > 1:
                            self._seen.add(key)
                    else:
                        self.report.left_out.append(path)
            finally:
                os.close(dir_fd)

    def directory(self, path: str) -> None:
        """A directory at `path`, before what it holds."""

    def link(self, dir_fd: int, name: str, path: str) -> None:
        """A symbolic link `name` in the open directory, at `path`."""

    def file(self, dir_fd: int, name: str, path: str, st: os.stat_result) -> None:
        """A regular file `name` in the open directory, at `path`, the first of its links."""

    def linked(self, key: tuple[int, int], path: str) -> None:
        """Another link, at `path`, to the file `key` (device, inode) met before."""

    def _measure(self, path: str, st: os.stat_result) -> None:
        self.report.bytes += st.st_size
        if self.report.bytes > self._max_bytes:
            raise UngradableWorkspaceError(
                f"the workspace holds more than {self._max_bytes // (1024 * 1024)} MiB of files "
                f"(sandbox.limits.workspace_mb; {path} is {st.st_size} bytes)"
            )

    def _count(self, path: str) -> None:
        self.report.entries += 1
        if self.report.entries > self._max_entries:
            raise UngradableWorkspaceError(
                f"the workspace holds more than {self._max_entries} entries "
                "(sandbox.limits.workspace_files)"
            )
        size = len(os.fsencode(path))
        if size > MAX_PATH_BYTES:
            raise UngradableWorkspaceError(
                f"the workspace holds a path of {size} bytes (at most {MAX_PATH_BYTES}): "
                f"{path[:200]}..."
            )


class _Copier(_Walk):
    """The walk that copies to `target`, still measuring (the workspace may have changed
    since it was measured)."""

    def __init__(self, limits: SandboxLimits, target: Path) -> None:
        super().__init__(limits)
        self._target = target
        self._copied: dict[tuple[int, int], str] = {}
        self.directory("")

    def directory(self, path: str) -> None:
        folder = self._target / path if path else self._target
        folder.mkdir(mode=0o755)

    def link(self, dir_fd: int, name: str, path: str) -> None:
        os.symlink(os.readlink(name, dir_fd=dir_fd), self._target / path)

    def linked(self, key: tuple[int, int], path: str) -> None:
        if key in self._copied:
            os.link(self._target / self._copied[key], self._target / path)
        else:
            self.report.left_out.append(path)  # the first link could not be copied

    def file(self, dir_fd: int, name: str, path: str, st: os.stat_result) -> None:
        target = self._target / path
        key = (st.st_dev, st.st_ino)
        try:
            fd = os.open(name, _READ, dir_fd=dir_fd)
        except OSError:
            self.report.left_out.append(path)
            return
        with contextlib.closing(_File(fd)) as source:
            opened = os.fstat(fd)
            if not stat.S_ISREG(opened.st_mode) or (opened.st_dev, opened.st_ino) != key:
                self.report.left_out.append(path)  # replaced since it was listed
                return
            out = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            try:
                for chunk in source.chunks(opened.st_size):
                    view = memoryview(chunk)
                    while view:
                        view = view[os.write(out, view) :]
                os.fchmod(out, (st.st_mode & 0o777) | 0o600)
            finally:
                os.close(out)
        if st.st_nlink > 1:
            self._copied[key] = path


class _File:
    """A source file open without blocking: read to at most the size it had when listed."""

    def __init__(self, fd: int) -> None:
        self._fd = fd

    def chunks(self, size: int) -> Iterator[bytes]:
        left = size
        while left > 0:
            try:
                chunk = os.read(self._fd, min(CHUNK, left))
            except BlockingIOError:  # a regular file never blocks; nothing else gets here
                return
            if not chunk:
                return
            left -= len(chunk)
            yield chunk

    def close(self) -> None:
        os.close(self._fd)


def _open_dir(root: int, rel: str) -> int | None:
    """The directory at `rel` under `root`, opened a name at a time without following a
    link; None when it cannot be (gone, or not a directory any more)."""
    fd = os.dup(root)
    try:
        for name in rel.split("/") if rel else ():
            child = os.open(name, _DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = child
    except OSError:
        os.close(fd)
        return None
    return fd


def _entries(dir_fd: int) -> Iterator[tuple[str, os.stat_result]]:
    """The entries of the open directory, each with its own (not followed) stat."""
    with os.scandir(dir_fd) as listing:
        for entry in listing:
            try:
                yield entry.name, entry.stat(follow_symlinks=False)
            except OSError:
                continue


def remove_tree(path: Path) -> None:
    """Remove the directory at `path` and all it holds, however deep (without recursion: the
    folders under its top are moved up to it, a level a pass) or long its paths (every name
    is taken from its folder's descriptor); links are removed, never followed; a folder its
    tests made unwritable is made writable first."""
    if not os.path.lexists(path):
        return
    top = os.open(path, _DIRECTORY)
    try:
        moved = 0
        while True:
            folders = [n for n, st in _entries(top) if stat.S_ISDIR(st.st_mode)]
            _empty_but_folders(top)
            if not folders:
                break
            for name in folders:
                sub = os.open(name, _DIRECTORY, dir_fd=top)
                try:
                    _empty_but_folders(sub)
                    for inner, _ in list(_entries(sub)):
                        moved = _free_name(top, moved)
                        os.rename(inner, f".darl-{moved}", src_dir_fd=sub, dst_dir_fd=top)
                finally:
                    os.close(sub)
                os.rmdir(name, dir_fd=top)
    finally:
        os.close(top)
    os.rmdir(path)


def _free_name(dir_fd: int, after: int) -> int:
    """The first n past `after` for which the open directory holds no `.darl-<n>`."""
    n = after + 1
    while True:
        try:
            os.stat(f".darl-{n}", dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            return n
        n += 1


def _empty_but_folders(dir_fd: int) -> None:
    """Unlink every entry of the open directory that is not a directory."""
    with contextlib.suppress(PermissionError):
        os.chmod(dir_fd, 0o700)
    for name, st in list(_entries(dir_fd)):
        if not stat.S_ISDIR(st.st_mode):
            os.unlink(name, dir_fd=dir_fd)
        else:
            with contextlib.suppress(PermissionError):
                os.chmod(name, 0o700, dir_fd=dir_fd, follow_symlinks=False)
