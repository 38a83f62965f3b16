"""What the agent changed in its workspace, against the task's commit: found by walking the
files themselves (never by asking git what it would track, so a `.gitignore` or a nested `.git`
the agent wrote hides nothing), and shown as a unified diff.

Nothing here follows a symbolic link: a link is compared, copied and shown as a link.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import stat
import tempfile
import zlib
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from darl.activities.sandbox.workspace import AttemptWorkspace, git
from darl.files import write_atomically

# git's modes for a file, an executable file, a symbolic link and a submodule.
REGULAR, EXECUTABLE, SYMLINK, SUBMODULE = "100644", "100755", "120000", "160000"

DIFF_CAP_BYTES = 64 * 1024
# A file bigger than this is named in the diff, not shown (nor hashed into git's objects).
DIFF_FILE_CAP_BYTES = 1024 * 1024


@dataclass(frozen=True)
class Committed:
    mode: str
    sha: str


@dataclass(frozen=True)
class TreeChanges:
    """Paths (relative, `/`-separated) the agent added, modified (content, mode or kind) or
    deleted; `committed` is the commit's whole tree, for restoring."""

    committed: dict[str, Committed]
    added: list[str] = field(default_factory=list)
    modified: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)

    @cached_property
    def changed(self) -> frozenset[str]:
        return frozenset((*self.added, *self.modified, *self.deleted))


async def committed_tree(workspace: AttemptWorkspace) -> dict[str, Committed]:
    out = await git(
        "ls-tree", "-r", "-z", "--full-tree", workspace.commit, git_dir=workspace.git_dir
    )
    tree = {}
    for record in out.split(b"\0"):
        if record:
            meta, path = record.split(b"\t", 1)
            mode, _kind, sha = meta.decode().split()
            tree[os.fsdecode(path)] = Committed(mode, sha)
    return tree


def tree_entries(root: Path) -> dict[str, os.stat_result]:
    """Every entry under `root` that is not a directory (files, links, anything else), by
    relative path; directories are walked, links are not followed."""
    found: dict[str, os.stat_result] = {}
    pending = [""]
    while pending:
        rel = pending.pop()
        with os.scandir(root / rel) as entries:
            for entry in entries:
                path = f"{rel}/{entry.name}" if rel else entry.name
                st = entry.stat(follow_symlinks=False)
                if stat.S_ISDIR(st.st_mode):
                    pending.append(path)
                else:
                    found[path] = st
    return found


def _blob_sha(data_path: Path, st: os.stat_result) -> str:
    """The id git gives the entry's content (a link's target for a link)."""
    if stat.S_ISLNK(st.st_mode):
        content = os.fsencode(os.readlink(data_path))
        return hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()
    digest = hashlib.sha1(b"blob %d\0" % st.st_size)
    with data_path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _same(path: Path, st: os.stat_result, committed: Committed) -> bool:
    if committed.mode == SYMLINK:
        return stat.S_ISLNK(st.st_mode) and _blob_sha(path, st) == committed.sha
    if not stat.S_ISREG(st.st_mode):
        return False
    executable = bool(st.st_mode & 0o111)
    if executable != (committed.mode == EXECUTABLE):
        return False
    return _blob_sha(path, st) == committed.sha


def compare(root: Path, committed: dict[str, Committed]) -> TreeChanges:
    """The changes of the tree at `root` against the commit (a synchronous walk: run it in a
    thread)."""
    entries = tree_entries(root)
    changes = TreeChanges(committed)
    for path, item in committed.items():
        if item.mode == SUBMODULE:
            continue
        st = entries.get(path)
        if st is None:
            changes.deleted.append(path)
        elif not _same(root / path, st, item):
            changes.modified.append(path)
    changes.added.extend(path for path in entries if path not in committed)
    for paths in (changes.added, changes.modified, changes.deleted):
        paths.sort()
    return changes


def _diffable(root: Path, changes: TreeChanges) -> tuple[list[str], list[str]]:
    """The changed paths the diff shows, and a line for each it cannot."""
    shown, unshown = [], []
    for path in (*changes.modified, *changes.added):
        if any(part.lower() == ".git" for part in path.split("/")):  # git will not index it
            unshown.append(f"# not shown (inside a .git directory): {path}")
        elif (size := (root / path).lstat().st_size) > DIFF_FILE_CAP_BYTES:
            unshown.append(f"# not shown ({size} bytes): {path}")
        else:
            shown.append(path)
    return shown, unshown


async def tree_diff(
    workspace: AttemptWorkspace, root: Path, changes: TreeChanges, cap: int = DIFF_CAP_BYTES
) -> tuple[str, bool]:
    """The changes as a unified diff against the commit, at most `cap` bytes, and whether
    it was cut. Built in a throwaway index holding the commit plus exactly the changed paths,
    whose contents DARL hashes into the attempt's git directory itself, as they are: no git
    attribute, filter or ignore rule of the agent's plays a part, and every file shows as
    text."""
    shown, unshown = await asyncio.to_thread(_diffable, root, changes)
    entries = await asyncio.to_thread(_stored, workspace.git_dir, root, shown)
    with tempfile.TemporaryDirectory(dir=workspace.attempt_dir, prefix="diff-") as tmp:
        # An empty work tree: git needs one to edit an index, and reads no attributes in it.
        empty = Path(tmp) / "tree"
        empty.mkdir()

        async def indexed(
            *args: str, stdin: bytes | None = None, limit: int | None = None
        ) -> bytes:
            return await git(
                *args,
                git_dir=workspace.git_dir,
                work_tree=empty,
                index=Path(tmp) / "index",
                stdin=stdin,
                limit=limit,
            )

        await indexed("read-tree", workspace.commit)
        if changes.deleted:
            await indexed(
                "update-index", "--force-remove", "-z", "--stdin", stdin=_z(changes.deleted)
            )
        if entries:
            await indexed("update-index", "-z", "--index-info", stdin=b"".join(entries))
        out = await indexed(
            "diff",
            "--cached",
            "--text",
            "--no-color",
            "--no-ext-diff",
            "--no-textconv",
            "--no-renames",
            workspace.commit,
            limit=cap + 1,
        )
    header = "".join(f"{line}\n" for line in unshown[:20])
    data = header.encode() + out
    if len(data) <= cap:
        return data.decode("utf-8", errors="replace"), False
    return data[:cap].decode("utf-8", errors="ignore"), True


def _stored(git_dir: Path, root: Path, paths: list[str]) -> list[bytes]:
    """Write each path's content (a link's target for a link) as a loose object of the git
    directory, as it is; their `--index-info` lines."""
    lines = []
    for path in paths:
        st = (root / path).lstat()
        if stat.S_ISLNK(st.st_mode):
            mode, content = SYMLINK, os.fsencode(os.readlink(root / path))
        else:
            mode = EXECUTABLE if st.st_mode & 0o111 else REGULAR
            content = (root / path).read_bytes()
        data = b"blob %d\0" % len(content) + content
        sha = hashlib.sha1(data).hexdigest()
        loose = git_dir / "objects" / sha[:2] / sha[2:]
        if not loose.exists():
            loose.parent.mkdir(exist_ok=True)
            write_atomically(loose, zlib.compress(data, 1))
        lines.append(f"{mode} {sha}\t".encode() + os.fsencode(path) + b"\0")
    return lines


def _z(paths: list[str]) -> bytes:
    return b"\0".join(os.fsencode(p) for p in paths)
