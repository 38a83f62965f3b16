"""Placeholders a local agent's spec may use for paths of the worker's machine, so one spec
file runs from any checkout: `{python}` the worker's interpreter, `{prefix}` its environment
(`sys.prefix`), `{cwd}` the directory the worker runs in (the checkout, for `darl dev`)."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path

from darl.workflows.contracts import SandboxSpec


def expand(text: str) -> str:
    """`text` with the placeholders replaced by this worker's paths."""
    if "{" not in text:
        return text
    return (
        text.replace("{python}", sys.executable)
        .replace("{prefix}", sys.prefix)
        .replace("{cwd}", os.getcwd())
    )


def expand_env(env: Mapping[str, str]) -> dict[str, str]:
    return {name: expand(value) for name, value in env.items()}


def expand_sandbox(sandbox: SandboxSpec) -> SandboxSpec:
    """The sandbox with its paths made this worker's: placeholders replaced, and a relative
    `repos_dir` or `read_only` path taken from the worker's working directory."""
    return sandbox.model_copy(
        update={
            "repos_dir": str(Path(expand(sandbox.repos_dir)).absolute()),
            "read_only": [str(Path(expand(path)).absolute()) for path in sandbox.read_only],
        }
    )
