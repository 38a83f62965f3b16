"""The shipped repositories as git mirrors, laid out as SWE-smith's are: a bare repository
per repository named `<owner>__<name>`, the clean code on `main`, and each instance's bug on
a branch named by its instance id. Commits are made with git plumbing under a fixed identity,
date and configuration, so every machine builds the same hashes."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from darl.examples.swe.instances import mirror_name

REPOS = Path(__file__).parent / "repos"
OWNER = "darl-swe"
IDENTITY = ("DARL SWE", "swe@darl.invalid")
DATE = "1767225600 +0000"  # 2026-01-01T00:00:00Z
ROOT_MESSAGE = "Initial commit\n"
BUG_MESSAGE = "Bug Patch\n"  # what SWE-smith's gather writes on its bug branches
# What a run of the repositories' tests leaves behind; never part of a mirror.
IGNORED_PARTS = {"__pycache__", ".pytest_cache", ".ruff_cache"}
GIT_TIMEOUT = 60


class MirrorError(RuntimeError):
    """A mirror cannot be built, or what was built is not what the instances name."""


def repository_files(root: Path) -> dict[str, bytes]:
    """The repository's files by path, with line endings normalised to LF."""
    files = {}
    for path in sorted(root.rglob("*")):
        relative = path.relative_to(root)
        if path.is_file() and not IGNORED_PARTS & set(relative.parts):
            files[relative.as_posix()] = path.read_bytes().replace(b"\r\n", b"\n")
    if not files:
        raise MirrorError(f"{root} holds no files")
    return files


def git_environment() -> dict[str, str]:
    """The user's configuration and git's own variables left out; identity and dates fixed."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    name, email = IDENTITY
    env.update(
        GIT_CONFIG_GLOBAL=os.devnull,
        GIT_CONFIG_NOSYSTEM="1",
        GIT_TERMINAL_PROMPT="0",
        GIT_AUTHOR_NAME=name,
        GIT_AUTHOR_EMAIL=email,
        GIT_AUTHOR_DATE=DATE,
        GIT_COMMITTER_NAME=name,
        GIT_COMMITTER_EMAIL=email,
        GIT_COMMITTER_DATE=DATE,
        LC_ALL="C",
    )
    return env


def git(
    args: list[str], git_dir: Path, *, stdin: bytes | None = None, index: Path | None = None
) -> str:
    """A git command on the bare repository `git_dir`; its output."""
    env = git_environment()
    if index is not None:
        env["GIT_INDEX_FILE"] = str(index)
    # A work tree that stays empty: `apply --cached` and `update-index` ask for one even
    # though they only touch the index.
    with tempfile.TemporaryDirectory(prefix="darl-swe-empty-") as empty:
        command = [
            "git",
            "-c",
            "commit.gpgSign=false",
            "-c",
            "core.autocrlf=false",
            f"--git-dir={git_dir}",
            f"--work-tree={empty}",
            *args,
        ]
        done = subprocess.run(
            command,
            input=stdin or b"",
            capture_output=True,
            env=env,
            timeout=GIT_TIMEOUT,
            check=False,
        )
    if done.returncode != 0:
        error = done.stderr.decode(errors="replace").strip()
        raise MirrorError(f"git {args[0]} failed in {git_dir}: {error}")
    return done.stdout.decode()


def init_mirror(git_dir: Path, files: Mapping[str, bytes]) -> str:
    """A new bare repository with `files` as the root commit of `main`; returns its hash."""
    if git_dir.exists():
        if not (git_dir / "HEAD").is_file() or not (git_dir / "objects").is_dir():
            raise MirrorError(f"{git_dir} exists and is not a git mirror: move it away")
        shutil.rmtree(git_dir)
    git_dir.parent.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        ["git", "init", "--quiet", "--bare", "--initial-branch=main", str(git_dir)],
        capture_output=True,
        env=git_environment(),
        timeout=GIT_TIMEOUT,
        check=False,
    )
    if done.returncode != 0:
        raise MirrorError(f"git init {git_dir} failed: {done.stderr.decode().strip()}")
    return commit(git_dir, None, files, [], "refs/heads/main", ROOT_MESSAGE)


def commit(
    git_dir: Path,
    parent: str | None,
    changed: Mapping[str, bytes],
    removed: Iterable[str],
    ref: str,
    message: str,
    patch: str | None = None,
) -> str:
    """A commit on `parent` with `changed` files written, `removed` ones deleted and `patch`
    reverse-applied; `ref` points at it. Every file is mode 100644."""
    with tempfile.TemporaryDirectory(prefix="darl-swe-index-") as scratch:
        index = Path(scratch) / "index"
        git(["read-tree", *([parent] if parent else ["--empty"])], git_dir, index=index)
        for path, data in sorted(changed.items()):
            blob = git(["hash-object", "-w", "--stdin"], git_dir, stdin=data).strip()
            git(
                ["update-index", "--add", "--cacheinfo", f"100644,{blob},{path}"],
                git_dir,
                index=index,
            )
        if patch is not None:
            git(["apply", "--cached", "--reverse", "-"], git_dir, stdin=patch.encode(), index=index)
        paths = sorted(removed)
        if paths:
            git(["update-index", "--force-remove", "--", *paths], git_dir, index=index)
        tree = git(["write-tree"], git_dir, index=index).strip()
    parents = ["-p", parent] if parent else []
    made = git(["commit-tree", tree, *parents], git_dir, stdin=message.encode()).strip()
    git(["update-ref", ref, made], git_dir)
    return made


def diff(git_dir: Path, old: str, new: str, paths: Iterable[str]) -> str:
    """`git diff old new -- paths` as SWE-bench's patches are written (a/ and b/ prefixes)."""
    options = ["--no-color", "--no-ext-diff", "--no-renames", "--src-prefix=a/", "--dst-prefix=b/"]
    return git(["diff-tree", "-p", "--abbrev=7", *options, old, new, "--", *paths], git_dir)


def added_files(test_patch: str) -> list[str]:
    """The files a patch creates (the hidden test files a test_patch adds back)."""
    files, current = [], None
    for line in test_patch.splitlines():
        if line.startswith("diff --git a/"):
            current = line.split(" b/", 1)[1]
        elif line.startswith("new file mode") and current is not None:
            files.append(current)
    return files


def build_mirrors(instances: list[dict[str, Any]], out: Path, repos: Path = REPOS) -> None:
    """A mirror in `out` for every repository under `repos`, with a branch per instance.
    Each instance's commit is its clean tree with its gold `patch` reverse-applied (the bug)
    and the files its `test_patch` adds removed; it must hash to the instance's base_commit."""
    if not repos.is_dir():
        raise MirrorError(
            f"{repos} does not exist: the task repositories ship in a DARL checkout "
            "(examples/swe/repos), not in the installed package; run this from a checkout"
        )
    by_repo: dict[str, list[dict[str, Any]]] = {}
    for instance in instances:
        by_repo.setdefault(instance["repo"], []).append(instance)
    names = sorted(p.name for p in repos.iterdir() if p.is_dir())
    unknown = sorted(set(by_repo) - {f"{OWNER}/{name}" for name in names})
    if unknown:
        raise MirrorError(f"instances name repositories not under {repos}: {', '.join(unknown)}")
    for name in names:
        repo = f"{OWNER}/{name}"
        git_dir = out / mirror_name(repo)
        root = init_mirror(git_dir, repository_files(repos / name))
        for instance in by_repo.get(repo, []):
            made = commit(
                git_dir,
                root,
                {},
                added_files(instance["test_patch"]),
                f"refs/heads/{instance['instance_id']}",
                BUG_MESSAGE,
                patch=instance["patch"],
            )
            if made != instance["base_commit"]:
                raise MirrorError(
                    f"{instance['instance_id']}: the rebuilt commit {made} is not its "
                    f"base_commit {instance['base_commit']}; {repos / name} changed since the "
                    "tasks were made: run `python -m darl.examples.swe.make_tasks tasks`"
                )
