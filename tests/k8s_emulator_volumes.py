"""Volumes for the Kubernetes API emulator's Pods (an emulator, not Kubernetes): each
PersistentVolumeClaim is a folder of its own, bound at once; a Pod's emptyDir and Secret
volumes are folders of the Pod's; a container's volumeMounts (subPath, readOnly) are bind
mounts made by bubblewrap over the host's root (`--dev-bind / /`), so the container's process
sees each volume at its mountPath, as in a Pod. No image is emulated: the rest of the
container's filesystem is the host's, so a mountPath must lie under a folder the host has.
"""

from __future__ import annotations

import base64
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


class VolumeNotReadyError(Exception):
    """A volume cannot be made yet: its claim or Secret does not exist (the kubelet waits)."""


class VolumeError(Exception):
    """A volume or mount the emulator cannot make at all (the container fails to create)."""


@dataclass(frozen=True)
class Mount:
    host: Path
    path: str
    read_only: bool


class Volumes:
    """The folders behind claims and Pod volumes, under `root`."""

    def __init__(self, root: Path, lookup: Callable[[str, str, str], dict | None]) -> None:
        self._root = root
        self._lookup = lookup  # (plural, namespace, name) -> the stored object or None

    def claim_dir(self, namespace: str, name: str) -> Path:
        return self._root / "claims" / namespace / name

    def claim_created(self, namespace: str, name: str) -> None:
        self.claim_dir(namespace, name).mkdir(parents=True, exist_ok=True)

    def claim_deleted(self, namespace: str, name: str) -> None:
        shutil.rmtree(self.claim_dir(namespace, name), ignore_errors=True)

    def pod_deleted(self, uid: str) -> None:
        shutil.rmtree(self._root / "pods" / uid, ignore_errors=True)

    def mounts(self, pod: dict, container: dict) -> list[Mount]:
        """The container's mounts, its Pod's volumes made on the way. Raises
        VolumeNotReadyError while a claim or Secret is missing, VolumeError otherwise."""
        meta = pod["metadata"]
        volumes = {v.get("name"): v for v in pod["spec"].get("volumes") or []}
        mounts = []
        for mount in container.get("volumeMounts") or []:
            volume = volumes.get(mount.get("name"))
            if volume is None:
                raise VolumeError(f"volumeMount {mount.get('name')!r} names no volume of the Pod")
            path = str(mount.get("mountPath", ""))
            if not os.path.isabs(path) or not Path(path).parent.is_dir():
                raise VolumeError(
                    f"mountPath {path!r}: the emulator mounts only under a folder the host has"
                )
            host = self._volume_dir(meta, volume)
            if mount.get("subPath"):
                host = host / mount["subPath"]
                host.mkdir(parents=True, exist_ok=True)
            mounts.append(Mount(host, path, bool(mount.get("readOnly"))))
        return mounts

    def _volume_dir(self, meta: dict, volume: dict) -> Path:
        namespace, name = meta["namespace"], volume["name"]
        if "persistentVolumeClaim" in volume:
            claim = volume["persistentVolumeClaim"].get("claimName", "")
            if self._lookup("persistentvolumeclaims", namespace, claim) is None:
                raise VolumeNotReadyError(f'persistentvolumeclaim "{claim}" not found')
            return self.claim_dir(namespace, claim)
        folder = self._root / "pods" / meta["uid"] / name
        if "emptyDir" in volume:
            folder.mkdir(parents=True, exist_ok=True)
            return folder
        if "secret" in volume:
            secret_name = volume["secret"].get("secretName", "")
            secret = self._lookup("secrets", namespace, secret_name)
            if secret is None:
                raise VolumeNotReadyError(f'secret "{secret_name}" not found')
            folder.mkdir(parents=True, exist_ok=True)
            data = secret.get("data") or {}
            # `items` projects the keys it names, each to its path; without it, every key.
            items = volume["secret"].get("items") or [{"key": k, "path": k} for k in data]
            for item in items:
                if item.get("key") not in data:
                    raise VolumeError(f'secret "{secret_name}" has no key {item.get("key")!r}')
                (folder / item["path"]).write_bytes(base64.b64decode(data[item["key"]]))
            return folder
        kinds = sorted(set(volume) - {"name"})
        raise VolumeError(f"volume {name!r}: the emulator has no {', '.join(kinds)} volumes")


def mounted(argv: list[str], mounts: list[Mount], cwd: str | None, bwrap: str) -> list[str]:
    """`argv` run with the mounts made (bubblewrap over the host's root), in `cwd`."""
    if not mounts:
        return argv
    wrapped = [bwrap, "--dev-bind", "/", "/"]
    # A folder before what is mounted inside it, as container runtimes order mounts.
    for mount in sorted(mounts, key=lambda m: len(Path(m.path).parts)):
        wrapped += ["--ro-bind" if mount.read_only else "--bind", str(mount.host), mount.path]
    if cwd:
        wrapped += ["--chdir", cwd]
    return [*wrapped, "--", *argv]
