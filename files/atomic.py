"""A file written whole or not at all: a reader (another process, a restarted one) sees the old
content or the new, never half of it. The new content goes to a temporary file of a unique name
in the same directory, which then replaces the file in one `os.replace` (a rename, atomic on
POSIX within a filesystem), so concurrent writers of one path never share a temporary file."""

from __future__ import annotations

import os
import secrets
from pathlib import Path


def write_atomically(path: Path, data: str | bytes, *, durable: bool = False) -> None:
    """Replace `path` with `data` (text is written as UTF-8), created with the permissions any
    new file gets (0o666 less the umask). The parent directory must exist. `durable` also
    fsyncs the content before the rename, for a file that must survive a power loss, not only
    the death of its writer (a rename alone survives a killed process)."""
    content = data.encode() if isinstance(data, str) else data
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        with open(tmp, "xb") as out:
            out.write(content)
            if durable:
                out.flush()
                os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
