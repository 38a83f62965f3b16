"""An attempt's workspace: the task's repository checked out at its commit in
`<attempt>/workspace`, with its git directory in `<attempt>/git`, outside the workspace, so
nothing the agent does can rewrite the commit the grader restores from.

The git directory borrows the mirror's objects (`objects/info/alternates`): a checkout costs
the files, never a copy of the history. Preparing is idempotent: `workspace.json` is written
last, and a workspace that has it is never made again (rule 3: a relaunch keeps the agent's
work); one without it is a launch that died half-way and is made afresh.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from darl.activities.agent_contract import task_field, task_path
from darl.activities.sandbox.errors import SandboxError, SandboxSpecError
from darl.files import write_atomically
from darl.workflows.contracts import SandboxSpec

WORKSPACE_DIR = "workspace"
GIT_DIR = "git"
READY_FILE = "workspace.json"

GIT_TIMEOUT_SECONDS = 300.0


@dataclass(frozen=True)
class AttemptWorkspace:
    """Where an attempt's files are: `tree` is the agent's working copy, `git_dir` the
    repository it was checked out from, `commit` the full id of the task's commit."""

    attempt_dir: Path
    commit: str

    @property
    def tree(self) -> Path:
        return self.attempt_dir / WORKSPACE_DIR

    @property
    def git_dir(self) -> Path:
        return self.attempt_dir / GIT_DIR


def git_env(git_dir: Path | None, work_tree: Path | None, index: Path | None) -> dict[str, str]:
    """The environment of DARL's own git commands: no user or system configuration (hooks,
    filters, aliases), no prompt, and only the repository DARL names."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env |= {
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_CONFIG_GLOBAL": os.devnull,
        "GIT_ATTR_NOSYSTEM": "1",
        "GIT_TERMINAL_PROMPT": "0",
    }
    if git_dir is not None:
        env["GIT_DIR"] = str(git_dir)
    if work_tree is not None:
        env["GIT_WORK_TREE"] = str(work_tree)
    if index is not None:
        env["GIT_INDEX_FILE"] = str(index)
    return env


async def git(
    *args: str,
    git_dir: Path | None = None,
    work_tree: Path | None = None,
    index: Path | None = None,
    stdin: bytes | None = None,
    cwd: Path | None = None,
    limit: int | None = None,
    timeout: float = GIT_TIMEOUT_SECONDS,
) -> bytes:
    """Run `git args...` and return its stdout, or its first `limit` bytes (git is stopped
    there); raises SandboxError with git's own message."""
    try:
        proc = await asyncio.create_subprocess_exec(
            "git",
            *args,
            stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=git_env(git_dir, work_tree, index),
            cwd=cwd,
        )
    except FileNotFoundError:
        raise SandboxSpecError("a sandbox needs git on PATH: apt-get install git") from None
    try:
        out, err, cut = await asyncio.wait_for(_collect(proc, stdin, limit), timeout)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        raise SandboxError(f"git {args[0]} took over {timeout:.0f} s (killed)") from None
    if proc.returncode != 0 and not cut:
        message = err.decode(errors="replace").strip().splitlines()
        raise SandboxError(f"git {' '.join(args[:3])} failed: {message[-1] if message else ''}")
    return out


async def _collect(
    proc: asyncio.subprocess.Process, stdin: bytes | None, limit: int | None
) -> tuple[bytes, bytes, bool]:
    """Feed stdin and read stdout and stderr together (no pipe can fill and stall git)."""

    async def feed() -> None:
        if proc.stdin is not None and stdin is not None:
            # git may end before it reads (its message, on stderr, says why); uvloop's pipe
            # says so with a RuntimeError, asyncio's with a BrokenPipeError.
            with contextlib.suppress(BrokenPipeError, ConnectionResetError, RuntimeError):
                proc.stdin.write(stdin)
                await proc.stdin.drain()
                proc.stdin.close()

    stdout, stderr = proc.stdout, proc.stderr
    if stdout is None or stderr is None:
        raise RuntimeError("git was started without pipes")

    async def read_out() -> tuple[bytes, bool]:
        chunks, size = [], 0
        while chunk := await stdout.read(1 << 16):
            chunks.append(chunk)
            size += len(chunk)
            if limit is not None and size >= limit:
                with contextlib.suppress(ProcessLookupError):  # it may have ended meanwhile
                    proc.kill()
                return b"".join(chunks)[:limit], True
        return b"".join(chunks), False

    _, (out, cut), err = await asyncio.gather(feed(), read_out(), stderr.read())
    await proc.wait()
    return out, err, cut


def mirror_of(sandbox: SandboxSpec, task: Any) -> tuple[str, Path]:
    """The task's repository name and the mirror that holds it (SWE-smith's naming)."""
    repo = task_field(task, task_path(sandbox.repo) or "", shown=sandbox.repo)
    if not isinstance(repo, str) or not repo.strip("./"):
        raise SandboxSpecError(f"the task's {sandbox.repo} must name a repository, not {repo!r}")
    return repo, Path(sandbox.repos_dir) / repo.replace("/", "__")


def commit_of(sandbox: SandboxSpec, task: Any) -> str:
    commit = task_field(task, task_path(sandbox.commit) or "", shown=sandbox.commit)
    if not isinstance(commit, str) or not commit or commit.startswith("-"):
        raise SandboxSpecError(f"the task's {sandbox.commit} must name a commit, not {commit!r}")
    return commit


async def _in_mirror(repo: str, mirror: Path, wanted: str) -> tuple[Path, str]:
    """The mirror's object store (bare repository or not) and the full id of the commit."""
    if not await asyncio.to_thread(mirror.is_dir):
        raise SandboxSpecError(
            f"no repository for {repo!r} at {mirror}: put a git mirror of it there "
            "(sandbox.repos_dir)"
        )
    # safe.directory: DARL only reads the mirror, whoever owns it.
    in_mirror = ("-c", "safe.directory=*", "-C", str(mirror))
    try:
        common = await git(*in_mirror, "rev-parse", "--path-format=absolute", "--git-common-dir")
    except SandboxError as err:
        raise SandboxSpecError(f"{mirror} is not a git repository: {err}") from None
    try:
        found = await git(
            *in_mirror,
            "rev-parse",
            "--verify",
            "--quiet",
            "--end-of-options",
            f"{wanted}^{{commit}}",
        )
    except SandboxError:
        raise SandboxSpecError(f"commit {wanted!r} of {repo!r} is not in {mirror}") from None
    return Path(os.fsdecode(common.strip())) / "objects", found.decode().strip()


async def prepare_workspace(
    sandbox: SandboxSpec, task: Any, attempt_dir: Path, timeout: float = GIT_TIMEOUT_SECONDS
) -> AttemptWorkspace:
    """The attempt's workspace, made now or as an earlier launch of the attempt left it."""
    ready = attempt_dir / READY_FILE
    if await asyncio.to_thread(ready.exists):
        return open_workspace(attempt_dir)
    repo, mirror = mirror_of(sandbox, task)
    objects, commit = await _in_mirror(repo, mirror, commit_of(sandbox, task))
    workspace = AttemptWorkspace(attempt_dir, commit)
    await asyncio.to_thread(_clear, workspace)
    # No template: no sample hooks, nothing to run on checkout.
    await git("init", "--quiet", "--bare", "--template=", str(workspace.git_dir))
    (workspace.git_dir / "objects" / "info").mkdir(parents=True, exist_ok=True)
    (workspace.git_dir / "objects" / "info" / "alternates").write_text(f"{objects}\n")
    workspace.tree.mkdir()
    await git(
        "checkout",
        "--quiet",
        "--force",
        "--detach",
        commit,
        git_dir=workspace.git_dir,
        work_tree=workspace.tree,
        timeout=timeout,
    )
    _write_ready(ready, {"repo": repo, "mirror": str(mirror), "commit": commit})
    return workspace


def _clear(workspace: AttemptWorkspace) -> None:
    """Remove what a launch that died half-way left (it never started an agent)."""
    for leftover in (workspace.tree, workspace.git_dir):
        if leftover.exists():
            shutil.rmtree(leftover)


def open_workspace(attempt_dir: Path) -> AttemptWorkspace:
    """The workspace an attempt's launch prepared; SandboxError if it has none."""
    try:
        ready = json.loads((attempt_dir / READY_FILE).read_text())
    except FileNotFoundError:
        raise SandboxError(f"attempt {attempt_dir} has no workspace (was it launched?)") from None
    return AttemptWorkspace(attempt_dir, commit=ready["commit"])


def _write_ready(path: Path, data: Mapping[str, str]) -> None:
    write_atomically(path, json.dumps(data))
