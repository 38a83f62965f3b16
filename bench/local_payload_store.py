"""The two stores `bench.payload_storage_bench` compares, on local disk: a Temporal External
Storage driver that stands in for S3/GCS, and a JSONL dataset read by row index through an
offset index. Both can be made slow (a latency per round trip) and can go down for a while."""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from temporalio.api.common.v1 import Payload
from temporalio.converter import (
    StorageDriver,
    StorageDriverActivityInfo,
    StorageDriverClaim,
    StorageDriverRetrieveContext,
    StorageDriverStoreContext,
    StorageDriverWorkflowInfo,
)

WORDS = [
    *("def", "return", "self", "import", "class", "raise", "assert", "None", "value"),
    *("error", "test", "patch", "django", "request", "response", "model", "field"),
    *("query", "index", "array", "matrix", "path", "file", "sympy"),
]


class StoreUnavailableError(RuntimeError):
    """The store is down (an injected outage)."""


@dataclass
class StoreStats:
    """Round trips and bytes one store served, and its injected outage."""

    latency_s: float = 0.0
    outage_s: float = 0.0
    puts: int = 0
    gets: int = 0
    round_trips: int = 0
    bytes_put: int = 0
    bytes_got: int = 0
    refused: int = 0
    _down_until: float | None = None

    async def round_trip(self) -> None:
        """One request to the store: its latency, or a refusal while it is down."""
        self.round_trips += 1
        if self._down_until is not None and time.monotonic() < self._down_until:
            self.refused += 1
            raise StoreUnavailableError("store unavailable (injected outage)")
        if self.latency_s:
            await asyncio.sleep(self.latency_s)

    def served(self) -> None:
        """After the first request served, the store goes down for `outage_s` (if set)."""
        if self.outage_s and self._down_until is None:
            self._down_until = time.monotonic() + self.outage_s


class LocalFileStorageDriver(StorageDriver):
    """A local-filesystem stand-in for the SDK's S3/GCS drivers, with their per-payload work:
    serialize, SHA-256, an exists check then a write (two round trips) to store; a read and a
    hash check (one round trip) to retrieve. Keys are scoped by workflow or activity, as theirs.
    Not for production: nothing outside this machine can read the files."""

    def __init__(self, root: Path, stats: StoreStats) -> None:
        self._root = root
        self.stats = stats

    def name(self) -> str:
        return "darl.bench.localfile"

    async def store(
        self, context: StorageDriverStoreContext, payloads: Sequence[Payload]
    ) -> list[StorageDriverClaim]:
        return list(await asyncio.gather(*(self._put(context, p) for p in payloads)))

    async def retrieve(
        self, context: StorageDriverRetrieveContext, claims: Sequence[StorageDriverClaim]
    ) -> list[Payload]:
        return list(await asyncio.gather(*(self._get(c) for c in claims)))

    async def _put(
        self, context: StorageDriverStoreContext, payload: Payload
    ) -> StorageDriverClaim:
        data = payload.SerializeToString()
        digest = hashlib.sha256(data).hexdigest()
        path = self._root / _scope(context) / digest
        await self.stats.round_trip()
        if not path.exists():
            await self.stats.round_trip()
            path.parent.mkdir(parents=True, exist_ok=True)
            partial = path.with_suffix(".partial")
            partial.write_bytes(data)
            partial.replace(path)
        self.stats.puts += 1
        self.stats.bytes_put += len(data)
        self.stats.served()
        return StorageDriverClaim(
            claim_data={"path": str(path.relative_to(self._root)), "sha256": digest}
        )

    async def _get(self, claim: StorageDriverClaim) -> Payload:
        await self.stats.round_trip()
        data = (self._root / claim.claim_data["path"]).read_bytes()
        if hashlib.sha256(data).hexdigest() != claim.claim_data["sha256"]:
            raise ValueError(f"stored payload {claim.claim_data['path']} fails its hash check")
        self.stats.gets += 1
        self.stats.bytes_got += len(data)
        self.stats.served()
        payload = Payload()
        payload.ParseFromString(data)
        return payload


def _scope(context: StorageDriverStoreContext) -> str:
    target = context.target
    if isinstance(target, StorageDriverWorkflowInfo):
        return f"wf/{target.id}/{target.run_id}"
    if isinstance(target, StorageDriverActivityInfo):
        return f"act/{target.id}"
    return "none"


class RowFile:
    """A JSONL dataset read by row index: an offset index built once, then one seek and one
    read (one round trip) a row."""

    def __init__(self, path: Path, stats: StoreStats) -> None:
        self._path = path
        self.stats = stats
        self._offsets = [0]
        with path.open("rb") as rows:
            for line in rows:
                self._offsets.append(self._offsets[-1] + len(line))

    def __len__(self) -> int:
        return len(self._offsets) - 1

    async def read(self, row: int) -> dict[str, Any]:
        await self.stats.round_trip()
        start, end = self._offsets[row], self._offsets[row + 1]
        with self._path.open("rb") as rows:
            rows.seek(start)
            data = rows.read(end - start)
        self.stats.gets += 1
        self.stats.bytes_got += len(data)
        self.stats.served()
        return json.loads(data)

    async def read_many(self, rows: Sequence[int]) -> list[dict[str, Any]]:
        return list(await asyncio.gather(*(self.read(r) for r in rows)))


def write_rows(path: Path, count: int, row_bytes: int, seed: int = 0) -> None:
    """`count` SWE-bench-shaped rows of about `row_bytes` of JSON each (word salad, which
    compresses about as real issue text and patches do)."""
    rng = random.Random(seed)

    def text(size: int) -> str:
        words: list[str] = []
        length = 0
        while length < size:
            word = rng.choice(WORDS)
            words.append(word)
            length += len(word) + 1
        return " ".join(words)

    with path.open("w") as out:
        for i in range(count):
            row = {
                "instance_id": f"repo__task-{i}",
                "repo": "owner/repo",
                "base_commit": f"{rng.getrandbits(160):040x}",
                "problem_statement": text(row_bytes // 6),
                "patch": text(row_bytes // 3),
                "test_patch": text(row_bytes // 2 - 400),
            }
            out.write(json.dumps(row) + "\n")
