"""The grader's copy of a workspace (activities/sandbox/workspace_copy.py) on its own: what it
copies, and that a workspace over its limits is refused before anything is written (an agent
that filled the disk the copy goes to must get its zero for its size, never a copy failed by
the full disk, which would be DARL's failure and not count)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from darl.activities.sandbox.errors import UngradableWorkspaceError
from darl.activities.sandbox.workspace_copy import copy_workspace
from darl.workflows.contracts import SandboxLimits

MIB = 1024 * 1024


def test_files_links_and_hard_links_are_copied_each_once(tmp_path: Path) -> None:
    source = tmp_path / "ws"
    (source / "pkg").mkdir(parents=True)
    (source / "pkg" / "a.py").write_text("A = 1\n")
    os.chmod(source / "pkg" / "a.py", 0o755)
    os.link(source / "pkg" / "a.py", source / "b.py")
    os.symlink("/etc/passwd", source / "outside")
    os.mkfifo(source / "fifo")

    report = copy_workspace(source, tmp_path / "copy", SandboxLimits())

    copy = tmp_path / "copy"
    assert (copy / "pkg" / "a.py").read_text() == "A = 1\n"
    assert os.stat(copy / "pkg" / "a.py").st_mode & 0o777 == 0o755
    assert os.path.samefile(copy / "pkg" / "a.py", copy / "b.py")
    assert os.readlink(copy / "outside") == "/etc/passwd"
    assert report.left_out == ["fifo"]
    assert report.bytes == len("A = 1\n")  # the hard link counted once
    assert report.entries == 5


def many_files_then_a_big_sparse_one(ws: Path) -> None:
    # 100 small files the copy would write first (in the old order), then 3 MiB of holes.
    for i in range(100):
        (ws / f"f{i:03}").write_bytes(b"x" * 1024)
    os.truncate(_touch(ws / "zz-sparse"), 3 * MIB)


def too_many_files(ws: Path) -> None:
    for i in range(101):
        (ws / f"f{i:03}").write_bytes(b"x")


def a_long_path(ws: Path) -> None:
    _touch(ws.joinpath(*["d" * 200] * 16, "f"))


@pytest.mark.parametrize(
    ("limits", "make", "message"),
    [
        (SandboxLimits(workspace_mb=2), many_files_then_a_big_sparse_one, "more than 2 MiB"),
        (SandboxLimits(workspace_files=100), too_many_files, "more than 100 entries"),
        (SandboxLimits(), a_long_path, "a path of"),
    ],
    ids=["bytes", "entries", "path length"],
)
def test_a_workspace_over_its_limits_is_refused_before_anything_is_written(
    tmp_path: Path, limits: SandboxLimits, make: Callable[[Path], None], message: str
) -> None:
    source = tmp_path / "ws"
    source.mkdir()
    make(source)
    target = tmp_path / "copy"

    with pytest.raises(UngradableWorkspaceError, match=message):
        copy_workspace(source, target, limits)

    assert not target.exists()


def _touch(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch()
    return path
