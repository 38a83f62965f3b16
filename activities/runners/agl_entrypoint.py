"""Runs an Agent Lightning style agent: `python -m darl.activities.runners.agl_entrypoint mod:Class`
imports the class (also `mod.Class`) and calls `Class().run()`, awaited if it is a coroutine.
Exit status 0 means the agent finished."""

from __future__ import annotations

import asyncio
import importlib
import inspect
import sys
from typing import Any


def load_class(target: str) -> type:
    module_name, sep, attr = target.partition(":")
    if not sep:
        module_name, _, attr = target.rpartition(".")
    if not module_name or not attr:
        raise SystemExit(f"entrypoint {target!r} is not 'module:Class' or 'module.Class'")
    return getattr(importlib.import_module(module_name), attr)


async def _await(awaitable: Any) -> Any:
    return await awaitable


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        raise SystemExit("usage: python -m darl.activities.runners.agl_entrypoint module:Class")
    result = load_class(argv[1])().run()
    if inspect.isawaitable(result):
        asyncio.run(_await(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
