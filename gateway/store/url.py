"""Which trajectory store a URL names: `s3://bucket/prefix` (an S3-compatible object store) or
a directory (`file:///path`, or a plain path). One function, `open_store`, for every process
that opens the store: the gateway, the trainer worker, the viewer."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from darl.gateway.errors import GatewayError
from darl.gateway.journal.base import JournalStorage
from darl.gateway.store.base import TrajectoryStore
from darl.gateway.store.directory import DirectoryTrajectoryStore


class StoreUrlError(GatewayError, ValueError):
    """A store URL that names no store (an unknown scheme, an S3 URL without a bucket)."""


@dataclass(frozen=True)
class StoreLocation:
    """A parsed store URL: a directory, or a bucket and a key prefix."""

    directory: Path | None = None
    bucket: str = ""
    prefix: str = ""

    @property
    def is_s3(self) -> bool:
        return self.directory is None

    def __str__(self) -> str:
        if self.directory is not None:
            return str(self.directory)
        return f"s3://{self.bucket}/{self.prefix}"


def parse_store_url(url: str | Path) -> StoreLocation:
    """Raises StoreUrlError for a URL that names no store."""
    if isinstance(url, Path):
        return StoreLocation(directory=url)
    parsed = urlparse(url)
    if parsed.scheme == "s3":
        if not parsed.netloc:
            raise StoreUrlError(f"{url!r}: an S3 store URL needs a bucket (s3://bucket/prefix)")
        return StoreLocation(bucket=parsed.netloc, prefix=parsed.path.strip("/"))
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise StoreUrlError(f"{url!r}: a file URL names a local path (file:///path)")
        return StoreLocation(directory=Path(parsed.path))
    if parsed.scheme == "" or (len(parsed.scheme) == 1 and url[1:3] in (":\\", ":/")):
        return StoreLocation(directory=Path(url))
    raise StoreUrlError(
        f"{url!r}: unknown store scheme {parsed.scheme!r} (use s3://bucket/prefix, "
        "file:///path or a directory)"
    )


def open_store(
    url: str | Path | StoreLocation,
    fsync: bool = False,
    endpoint_url: str | None = None,
) -> TrajectoryStore:
    """The store `url` names. S3 settings come from the usual `AWS_*` variables
    (`AWS_ENDPOINT_URL` for an S3-compatible server) unless `endpoint_url` is given;
    `fsync` is the directory store's. Nothing is contacted yet: `await store.check()` does."""
    where = url if isinstance(url, StoreLocation) else parse_store_url(url)
    if where.directory is not None:
        return DirectoryTrajectoryStore(where.directory, fsync=fsync)
    from darl.gateway.store.s3 import S3TrajectoryStore

    return S3TrajectoryStore(where.bucket, where.prefix, endpoint_url=endpoint_url)


def journal_storage(
    url: str | Path | StoreLocation, endpoint_url: str | None = None
) -> Path | JournalStorage:
    """Where the gateway journal lives beside the store `url` names: `<dir>/_gateway`, or
    objects under `<prefix>/_gateway/` of its bucket (for `GatewayJournal`)."""
    where = url if isinstance(url, StoreLocation) else parse_store_url(url)
    if where.directory is not None:
        return where.directory / "_gateway"
    from darl.gateway.journal.s3 import S3Journal

    return S3Journal(where.bucket, where.prefix, endpoint_url)
