"""Undoing what an agent may have done to pass tests without fixing the code, in the grading
copy of its workspace: every changed file that the tests or DARL's own git read (test files,
conftest.py, pytest and packaging configuration, git attributes, the files the hidden test
patch touches) is restored from the commit, and whatever the agent added that Python or
pytest would load, or that could stand in for a result (conftest.py, sitecustomize, .pth
files, byte code and caches, new test or configuration files, git attributes, a module of any
importable kind shadowing one of the standard library or pytest), is removed.

Runs outside the sandbox on a copy nobody else writes; it never follows a link the agent made.
"""

from __future__ import annotations

import asyncio
import importlib.machinery
import os
import re
import stat
import sys
from collections.abc import Callable, Iterable
from fnmatch import fnmatchcase
from pathlib import Path

from darl.activities.sandbox.changes import EXECUTABLE, SUBMODULE, SYMLINK, TreeChanges
from darl.activities.sandbox.errors import SandboxError
from darl.activities.sandbox.workspace import AttemptWorkspace, git
from darl.activities.sandbox.workspace_copy import remove_tree

TEST_DIRS = frozenset({"tests", "test"})
TEST_FILE_PATTERNS = ("test_*.py", "*_test.py")
# pytest reads its configuration from any of these, nearest the tests first; setup.py and
# the packaging files decide what an installed package is.
CONFIG_FILES = frozenset(
    {"pytest.ini", ".pytest.ini", "pytest.toml", ".pytest.toml", "tox.ini", "setup.cfg"}
    | {"pyproject.toml", "setup.py"}
)
# Loaded by Python at start-up or by pytest while collecting; read by DARL's own git.
LOADED_FILES = frozenset({"conftest.py", "sitecustomize.py", "usercustomize.py", ".gitattributes"})
LOADED_SUFFIXES = (".pth", ".pyc", ".pyo")
CACHE_DIRS = frozenset({"__pycache__", ".pytest_cache"})
# A module of these names where Python would find it first (the repository's top, or any
# folder pytest puts on sys.path: one that is not a package) would be imported instead of
# the real one, by pytest or by the standard library itself, even late in the run.
SHADOWED_MODULES = frozenset(sys.stdlib_module_names) | {
    "pytest",
    "_pytest",
    "pluggy",
    "py",
    "iniconfig",
    "packaging",
    "exceptiongroup",
    "tomli",
    "pygments",
    "colorama",
}
# Every ending Python imports a module from (source, byte code, extension modules).
IMPORTABLE_SUFFIXES = tuple(
    sorted({*importlib.machinery.all_suffixes(), ".pyw"}, key=len, reverse=True)
)


def read_by_tests(path: str) -> bool:
    """True for a path the test run reads as test code, configuration or start-up code, or
    DARL's own git reads."""
    parts = path.split("/")
    name = parts[-1]
    return (
        any(part in TEST_DIRS or part in CACHE_DIRS for part in parts)
        or any(fnmatchcase(name, pattern) for pattern in TEST_FILE_PATTERNS)
        or name in CONFIG_FILES
        or name in LOADED_FILES
        or name.endswith(LOADED_SUFFIXES)
    )


def module_name(file_name: str) -> str | None:
    """The module a file of this name is imported as, if Python imports it at all."""
    for suffix in IMPORTABLE_SUFFIXES:
        if file_name.endswith(suffix) and len(file_name) > len(suffix):
            return file_name[: -len(suffix)]
    return None


def shadows_a_module(path: str, is_package: Callable[[str], bool] = lambda _: False) -> bool:
    """A file that would be imported as a module pytest or the standard library provides:
    `name.<any importable ending>` or `name/__init__.<ending>` in a folder that is not a
    package (`is_package(folder)`, "" for the repository's top), which is where a test run
    finds top-level modules."""
    parts = path.split("/")
    name = module_name(parts[-1])
    if name == "__init__":
        if len(parts) < 2:
            return False
        name, parts = parts[-2], parts[:-1]
    return name in SHADOWED_MODULES and not is_package("/".join(parts[:-1]))


_PATCH_PATH = re.compile(r"^(?:---|\+\+\+) [ab]/(.+?)\t?$")


def patch_paths(patch: str) -> list[str]:
    """The paths a unified diff touches (its `--- a/` and `+++ b/` lines)."""
    found: dict[str, None] = {}
    for line in patch.splitlines():
        match = _PATCH_PATH.match(line)
        if match:
            found[match[1]] = None
    return list(found)


def _remove(path: Path) -> None:
    if stat.S_ISDIR(path.lstat().st_mode):
        remove_tree(path)  # however deep the agent made it: no recursion
    else:
        path.unlink()


def _real_parents(root: Path, path: str) -> None:
    """Make every directory above `path` a real directory: a link or file the agent put in
    place of one is removed (restored files are never written through a link)."""
    current = root
    for part in path.split("/")[:-1]:
        current = current / part
        try:
            st = current.lstat()
        except FileNotFoundError:
            current.mkdir()
            continue
        if not stat.S_ISDIR(st.st_mode):
            current.unlink()
            current.mkdir()


async def _blobs(workspace: AttemptWorkspace, shas: Iterable[str]) -> dict[str, bytes]:
    wanted = sorted(set(shas))
    if not wanted:
        return {}
    out = await git(
        "cat-file", "--batch", git_dir=workspace.git_dir, stdin="\n".join(wanted).encode() + b"\n"
    )
    blobs, at = {}, 0
    for sha in wanted:
        header_end = out.index(b"\n", at)
        found, _kind, size = out[at:header_end].decode().split()
        if found != sha:
            raise SandboxError(f"git cat-file answered {found} for {sha}")
        start = header_end + 1
        blobs[sha] = out[start : start + int(size)]
        at = start + int(size) + 1
    return blobs


async def restore_and_remove(
    workspace: AttemptWorkspace,
    root: Path,
    changes: TreeChanges,
    also_restore: Iterable[str] = (),
) -> tuple[list[str], list[str]]:
    """Undo the agent's changes to what the tests read in the tree at `root`: returns the
    paths restored from the commit and the paths removed. `also_restore` are paths that
    must be as committed whatever their names (the test patch's, the listed tests' files);
    such a path the commit lacks is removed, so the patch can create it."""
    extra = set(also_restore)

    def is_package(folder: str) -> bool:
        # As pytest tells a package from a folder it puts on sys.path (a regular
        # `__init__.py`): an `__init__` of another kind, which this removal may take away,
        # makes no package of a folder whose modules would then shadow others.
        if not folder:
            return False
        try:
            return stat.S_ISREG((root / folder / "__init__.py").lstat().st_mode)
        except OSError:
            return False

    removed = await asyncio.to_thread(
        lambda: [p for p in changes.added if read_by_tests(p) or shadows_a_module(p, is_package)]
    )
    removed += sorted(extra - changes.committed.keys())
    restored = sorted(
        path
        for path in changes.changed
        if path in changes.committed
        and changes.committed[path].mode != SUBMODULE
        and (read_by_tests(path) or path in extra)
    )
    blobs = await _blobs(workspace, (changes.committed[p].sha for p in restored))
    gone = await asyncio.to_thread(_rewrite, root, removed, restored, changes, blobs)
    return restored, sorted(set(gone))


def _rewrite(
    root: Path,
    removed: list[str],
    restored: list[str],
    changes: TreeChanges,
    blobs: dict[str, bytes],
) -> list[str]:
    """Remove, then restore, in the tree; returns what was there to remove."""
    gone = []
    for path in removed:
        _real_parents(root, path)
        if os.path.lexists(root / path):
            _remove(root / path)
            gone.append(path)
    for path in restored:
        item = changes.committed[path]
        _real_parents(root, path)
        target = root / path
        if os.path.lexists(target):
            _remove(target)
        if item.mode == SYMLINK:
            os.symlink(os.fsdecode(blobs[item.sha]), target)
        else:
            target.write_bytes(blobs[item.sha])
            target.chmod(0o755 if item.mode == EXECUTABLE else 0o644)
    return gone


async def apply_test_patch(workspace: AttemptWorkspace, root: Path, patch: str) -> None:
    """Apply the task's hidden test patch to the tree (git refuses to write through a link)."""
    if not patch.strip():
        return
    try:
        await git(
            "apply",
            "--whitespace=nowarn",
            "-",
            git_dir=workspace.git_dir,
            work_tree=root,
            cwd=root,
            stdin=patch.encode(),
        )
    except SandboxError as err:
        raise SandboxError(
            f"the task's test_patch does not apply to {workspace.commit[:12]} with the "
            f"test files restored: {err}"
        ) from None
