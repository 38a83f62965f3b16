"""Kubernetes objects checked as the API server would, without a cluster: the OpenAPI schema of
one pinned Kubernetes version (kubernetes-validate, strict: unknown fields are errors), plus the
checks the schema cannot express (names, label syntax, quantities, Secret data). The manifest
tests and the Job runner's tests validate every object through `validate`."""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Iterator, Mapping
from typing import Any

import kubernetes_validate

# The oldest Kubernetes whose schema the manifests and the runner's Jobs must satisfy: still
# offered by the managed services, and the schemas only grow, so what is valid here is valid
# on the newer versions kubernetes-validate ships (up to 1.37 in 1.37.0). Pass it as
# "major.minor": kubernetes-validate compares versions as strings ("1.100" < "1.25").
KUBERNETES_VERSION = "1.33"

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_DNS_1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_QUALIFIED_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_QUANTITY = re.compile(r"^[+-]?(\d+(\.\d*)?|\.\d+)([KMGTPE]i|[numkMGTPE]|[eE][+-]?\d+)?$")
_CONFIG_KEY = re.compile(r"^[-._a-zA-Z0-9]+$")
# Kinds whose names are DNS labels rather than subdomains (a Job's name becomes the
# batch.kubernetes.io/job-name label of its Pods), and RFC 1035 labels (Services).
_LABEL_NAMED = {"Namespace", "Job", "Pod"}
_RFC1035_NAMED = {"Service"}
# RBAC names may be any path segment ("system:controller:x").
_PATH_SEGMENT_NAMED = {"Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding"}
_MAX_ANNOTATIONS_BYTES = 256 * 1024


class InvalidObject(ValueError):
    """A Kubernetes object the API server would refuse; `problems` lists each reason."""

    def __init__(self, what: str, problems: list[str]) -> None:
        self.what = what
        self.problems = problems
        super().__init__(
            f"{what} is not valid Kubernetes {KUBERNETES_VERSION}:\n  - " + "\n  - ".join(problems)
        )


def validate(obj: Mapping[str, Any]) -> None:
    """Raise InvalidObject, naming the object and each problem's path, unless the API server of
    KUBERNETES_VERSION would accept `obj` as far as can be told without a cluster. An unknown
    kind or apiVersion is a problem too (kubernetes-validate only warns about those)."""
    what = describe(obj)
    if not isinstance(obj.get("apiVersion"), str) or not isinstance(obj.get("kind"), str):
        raise InvalidObject(what, ["apiVersion and kind must be strings"])
    try:
        kubernetes_validate.validate(dict(obj), KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as err:
        raise InvalidObject(what, [f"{_path(err.absolute_path)}: {err.message}"]) from err
    except kubernetes_validate.SchemaNotFoundError as err:
        raise InvalidObject(what, [err.message]) from err
    problems = [*_name_problems(obj), *_metadata_problems(obj), *_quantity_problems(obj)]
    if obj["kind"] in ("Secret", "ConfigMap"):
        problems += _data_problems(obj)
    if problems:
        raise InvalidObject(what, problems)


def describe(obj: Mapping[str, Any]) -> str:
    """`Kind namespace/name`, as far as the object says."""
    metadata = obj.get("metadata") or {}
    name = metadata.get("name") or metadata.get("generateName") or "<no name>"
    namespace = metadata.get("namespace")
    return f"{obj.get('kind', '<no kind>')} {namespace + '/' if namespace else ''}{name}"


def _path(parts: Any) -> str:
    text = ""
    for part in parts:
        text += f"[{part}]" if isinstance(part, int) else f".{part}"
    return text.lstrip(".") or "<root>"


def _name_problems(obj: Mapping[str, Any]) -> list[str]:
    metadata = obj.get("metadata") or {}
    name = metadata.get("name")
    if name is None:
        return [] if metadata.get("generateName") else ["metadata.name is missing"]
    kind = obj["kind"]
    if kind in _PATH_SEGMENT_NAMED:
        ok = name not in (".", "..") and "/" not in name and "%" not in name
        rule = "a path segment"
    elif kind in _RFC1035_NAMED:
        ok, rule = len(name) <= 63 and bool(_DNS_1035_LABEL.match(name)), "an RFC 1035 label"
    elif kind in _LABEL_NAMED:
        ok, rule = len(name) <= 63 and bool(_DNS_LABEL.match(name)), "a DNS-1123 label"
    else:
        ok, rule = len(name) <= 253 and bool(_DNS_SUBDOMAIN.match(name)), "a DNS-1123 subdomain"
    problems = [] if ok else [f"metadata.name {name!r} is not {rule}"]
    namespace = metadata.get("namespace")
    if namespace is not None and not (len(namespace) <= 63 and _DNS_LABEL.match(namespace)):
        problems.append(f"metadata.namespace {namespace!r} is not a DNS-1123 label")
    return problems


def _walk(node: Any, path: str = "") -> Iterator[tuple[str, str, Any]]:
    """(path, key, value) for every mapping entry in the object, depth first."""
    if isinstance(node, Mapping):
        for key, value in node.items():
            child = f"{path}.{key}" if path else str(key)
            yield child, str(key), value
            yield from _walk(value, child)
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from _walk(value, f"{path}[{index}]")


def _qualified_key_problem(key: str) -> str | None:
    prefix, _, name = key.rpartition("/")
    if prefix and not (len(prefix) <= 253 and _DNS_SUBDOMAIN.match(prefix)):
        return f"key {key!r}: prefix is not a DNS-1123 subdomain"
    if not (len(name) <= 63 and _QUALIFIED_NAME.match(name)):
        return f"key {key!r}: name is not 1-63 of [A-Za-z0-9._-] with alphanumeric ends"
    return None


def _metadata_problems(obj: Mapping[str, Any]) -> list[str]:
    """Labels, selectors and annotations anywhere in the object (Pod templates included)."""
    problems = []
    for path, key, value in _walk(obj):
        if key in ("labels", "matchLabels", "nodeSelector") and isinstance(value, Mapping):
            for label, text in value.items():
                problem = _qualified_key_problem(str(label))
                if problem is None and not (
                    isinstance(text, str) and len(text) <= 63 and _LABEL_VALUE.match(text)
                ):
                    problem = f"{label!r}: {text!r} is not a label value (<= 63 characters)"
                if problem:
                    problems.append(f"{path}: {problem}")
        elif key == "annotations" and isinstance(value, Mapping):
            problems += [f"{path}: {p}" for k in value if (p := _qualified_key_problem(str(k)))]
            size = sum(len(str(k)) + len(str(v)) for k, v in value.items())
            if size > _MAX_ANNOTATIONS_BYTES:
                problems.append(f"{path}: {size} bytes, more than 256 KiB")
    return problems


def _quantity_problems(obj: Mapping[str, Any]) -> list[str]:
    problems = []
    for path, key, value in _walk(obj):
        if key in ("requests", "limits") and isinstance(value, Mapping):
            entries = [(f"{path}.{name}", quantity) for name, quantity in value.items()]
        elif key == "sizeLimit":
            entries = [(path, value)]
        else:
            continue
        for where, quantity in entries:
            if isinstance(quantity, bool) or not _QUANTITY.match(str(quantity)):
                problems.append(f"{where}: {quantity!r} is not a quantity")
    return problems


def _data_problems(obj: Mapping[str, Any]) -> list[str]:
    problems = []
    for field in ("data", "stringData", "binaryData"):
        for key, value in (obj.get(field) or {}).items():
            if not (len(key) <= 253 and _CONFIG_KEY.match(key)):
                problems.append(f"{field}.{key}: not a valid key")
            if (obj["kind"], field) in (("Secret", "data"), ("ConfigMap", "binaryData")):
                try:
                    base64.b64decode(value, validate=True)
                except (binascii.Error, TypeError, ValueError):
                    problems.append(f"{field}.{key}: not base64")
    return problems
