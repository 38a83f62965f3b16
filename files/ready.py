"""A process's ready file: the JSON a server or worker publishes, whole, once it serves (its
address or task queue, and its pid), which whoever started it waits for and reads."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from darl.files.atomic import write_atomically


def write_ready_file(path: Path, info: dict[str, Any]) -> None:
    """Publish `info` with this process's `pid` at `path`, creating its directory; a reader
    never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, json.dumps({**info, "pid": os.getpid()}))
