"""The gateway journal's storage in a directory (`DirectoryJournal`), beside a directory
trajectory store; `S3Journal` (`journal/s3.py`) keeps the same documents in the store's bucket."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from darl.files import write_atomically

log = logging.getLogger(__name__)

OUTAGES_FILE = "outages.jsonl"


class DirectoryJournal:
    """`root/<name>.json` by atomic rename, `root/outages.jsonl` appended."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.root.mkdir(parents=True, exist_ok=True)
        self._outages: list[dict[str, Any]] = []
        self._outages_read_at: tuple[int, int] = (-1, -1)

    def read(self, name: str) -> dict[str, Any] | None:
        path = self.root / name
        try:
            data: dict[str, Any] = json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except ValueError:
            # Written by an atomic rename, so never torn; anything else is not ours to guess at.
            log.error("%s is not JSON; ignoring it", path)
            return None
        return data

    def write(self, name: str, data: dict[str, Any]) -> None:
        # Replicas write the admin state at once: each write has a temporary file of its own.
        write_atomically(self.root / name, json.dumps(data))

    def names(self, prefix: str) -> list[str]:
        return sorted(p.name for p in self.root.glob(f"{prefix}*.json"))

    def add_outage(self, outage: dict[str, Any]) -> None:
        with (self.root / OUTAGES_FILE).open("a") as f:
            f.write(json.dumps(outage) + "\n")

    def outages(self) -> list[dict[str, Any]]:
        """Re-read only when the file changed: closes ask for every attempt."""
        path = self.root / OUTAGES_FILE
        try:
            stat = path.stat()
        except FileNotFoundError:
            return []
        changed = (stat.st_mtime_ns, stat.st_size)
        if changed != self._outages_read_at:
            lines = path.read_text().splitlines()
            self._outages = [json.loads(line) for line in lines if line.strip()]
            self._outages_read_at = changed
        return self._outages
