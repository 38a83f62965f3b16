"""The gateway journal's storage in the trajectory store's bucket, so replicas on Kubernetes
share it without a volume: `<prefix>/_gateway/<name>` per document, one object per outage
under `<prefix>/_gateway/outages/`. Synchronous (obstore's blocking calls): the gateway calls
the journal on a thread."""

from __future__ import annotations

import json
import uuid
from typing import Any

import obstore

from darl.gateway.store.s3 import s3_object_store


class S3Journal:
    """A `JournalStorage` (gateway/journal.py) over S3; endpoint and credentials as for
    `S3TrajectoryStore`."""

    def __init__(self, bucket: str, prefix: str = "", endpoint_url: str | None = None) -> None:
        self.bucket = bucket
        base = prefix.strip("/")
        self._s3 = s3_object_store(bucket, f"{base}/_gateway" if base else "_gateway", endpoint_url)
        # Outages by key: closes ask for every attempt, so only new keys are fetched.
        self._outages: dict[str, dict[str, Any]] = {}

    def read(self, name: str) -> dict[str, Any] | None:
        try:
            found = obstore.get(self._s3, name)
        except FileNotFoundError:
            return None
        data: dict[str, Any] = json.loads(bytes(found.bytes()))
        return data

    def write(self, name: str, data: dict[str, Any]) -> None:
        # A PUT replaces an object whole: readers see the old one or the new one.
        obstore.put(self._s3, name, json.dumps(data).encode())

    def names(self, prefix: str) -> list[str]:
        listed = obstore.list_with_delimiter(self._s3, None)["objects"]
        return sorted(o["path"] for o in listed if o["path"].startswith(prefix))

    def add_outage(self, outage: dict[str, Any]) -> None:
        since_ns = int(float(outage["since"]) * 1e9)
        key = f"outages/{since_ns:020d}-{uuid.uuid4().hex[:12]}.json"
        obstore.put(self._s3, key, json.dumps(outage).encode())

    def outages(self) -> list[dict[str, Any]]:
        keys = sorted(o["path"] for o in obstore.list(self._s3, "outages/").collect())
        for key in keys:
            if key not in self._outages:
                self._outages[key] = json.loads(bytes(obstore.get(self._s3, key).bytes()))
        return [self._outages[key] for key in keys]
