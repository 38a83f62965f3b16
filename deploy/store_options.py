"""The `--store-url` option the commands that open the trajectory store share (the gateway,
the trainer worker, the viewer, `darl trajectory`), and opening the store it names with a
one-line error, before anything starts, for a URL that names no store or a store that
cannot be used."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

if TYPE_CHECKING:
    from darl.gateway.store.base import TrajectoryStore
    from darl.gateway.store.url import StoreLocation

StoreUrl = Annotated[
    str | None,
    typer.Option(
        envvar="DARL_STORE_URL",
        help="The trajectory store: s3://bucket/prefix (endpoint and credentials from the "
        "AWS_* variables: AWS_ENDPOINT_URL for an S3-compatible server), file:///path or a "
        "directory. Wins over --store-dir.",
    ),
]


def store_location(store_url: str | None, store_dir: Path) -> StoreLocation:
    """The store `--store-url` names, else the directory `--store-dir`."""
    from darl.gateway.store.url import StoreLocation, StoreUrlError, parse_store_url

    if store_url is None:
        return StoreLocation(directory=store_dir)
    try:
        return parse_store_url(store_url)
    except StoreUrlError as err:
        raise typer.BadParameter(str(err), param_hint="--store-url") from err


def open_checked_store(location: StoreLocation, fsync: bool = False) -> TrajectoryStore:
    """The store, once it answered (a bucket that exists, credentials it takes); else a
    one-line error and exit status 2."""
    from darl.gateway.store.base import StoreUnavailableError
    from darl.gateway.store.url import open_store

    store = open_store(location, fsync=fsync)

    async def check() -> None:
        try:
            await store.check()
        finally:
            await store.aclose()

    try:
        asyncio.run(check())
    except StoreUnavailableError as err:
        typer.echo(f"error: the trajectory store {location}: {err}", err=True)
        raise typer.Exit(2) from err
    return store
