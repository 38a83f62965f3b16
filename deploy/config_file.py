"""A training run's config file: YAML or JSON in (made from another file's, `extends:`),
`--set key=value` overrides on top, a validated TrainingConfig with absolute paths out. Used
by `darl train`, the demo and the tests alike.

A relative path means the directory of the file it is written in (the config file's; a --set
on the command line: the current directory), as every config system users know has it, except
one under `.darl/`, which names the dev stack's home (the running stack's, wherever it is, or
`.darl` here): `backend.model_dir: .darl/models/digits` is the stack's digits model."""

from __future__ import annotations

import difflib
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from darl.deploy.errors import DeployError, single_line
from darl.workflows import errors
from darl.workflows.training_config import TrainingConfig


class ConfigFileError(DeployError, ValueError):
    """A config file that cannot be read or is not a TrainingConfig; the message is one line."""


# The config's paths (dotted keys), resolved as the module says.
PATH_KEYS = (
    "dataset.path",
    "validation.path",
    "backend.model_dir",
    "run_dir",
    "rollout.agent.job_template",
)
STACK_HOME_PREFIX = ".darl"
# A file's key naming the config file it is made from (its sections replace that one's).
EXTENDS_KEY = "extends"


def load_config(
    path: Path,
    run_id: str | None = None,
    overrides: Sequence[str] = (),
    home: Path | None = None,
) -> TrainingConfig:
    """A TrainingConfig from YAML or JSON; `overrides` (`key=value`, dotted keys, values as
    YAML scalars, typed by the model) and then `run_id` override the file's. Paths resolve
    against the file's directory (`.darl/...` against `home`, the dev stack's). A file that is
    not one, or an override of an unknown key or of a wrong type, raises ConfigFileError with
    one line saying what is wrong."""
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as err:
        raise ConfigFileError(f"{path}: {single_line(str(err))}") from err
    if not isinstance(data, dict):
        raise ConfigFileError(f"{path}: expected a mapping of config keys")
    data = with_base(path, data, home)
    resolve_paths(data, path.resolve().parent, home)
    for override in overrides:
        apply_override(data, override)
    if run_id:
        data["run_id"] = run_id
    # What is still relative came from the command line (--set): the current directory's.
    resolve_paths(data, Path.cwd(), home)
    try:
        return TrainingConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigFileError(f"{path}: {errors.one_line(err.errors())}") from err


def with_base(
    path: Path, data: dict[str, Any], home: Path | None, seen: tuple[Path, ...] = ()
) -> dict[str, Any]:
    """The config of a file that `extends` another (a path, from its own directory): the
    other file's, each top-level section this one gives in place of the other's whole."""
    base_name = data.pop(EXTENDS_KEY, None)
    if base_name is None:
        return data
    if not isinstance(base_name, str):
        raise ConfigFileError(f"{path}: {EXTENDS_KEY} must name a config file")
    base_path = (path.resolve().parent / base_name).resolve()
    if base_path in (*seen, path.resolve()):
        raise ConfigFileError(f"{path}: {EXTENDS_KEY} goes round to {base_path}")
    try:
        base = yaml.safe_load(base_path.read_text())
    except (OSError, yaml.YAMLError) as err:
        raise ConfigFileError(f"{path}: {EXTENDS_KEY}: {single_line(str(err))}") from err
    if not isinstance(base, dict):
        raise ConfigFileError(f"{base_path}: expected a mapping of config keys")
    base = with_base(base_path, base, home, (*seen, path.resolve()))
    # The base's relative paths are its own directory's.
    resolve_paths(base, base_path.parent, home)
    return {**base, **data}


def resolve_paths(data: dict[str, Any], base: Path, home: Path | None) -> None:
    """Make the config's relative paths (PATH_KEYS) absolute, in place: against `base`, or
    `home` for one under `.darl/`. The workers may run elsewhere, so they get absolute ones."""
    for key in PATH_KEYS:
        *parents, leaf = key.split(".")
        node: Any = data
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and isinstance(node.get(leaf), str):
            node[leaf] = str(resolved_path(node[leaf], base, home))


def resolved_path(value: str, base: Path, home: Path | None) -> Path:
    path = Path(value).expanduser()
    if path.is_absolute():
        return path.resolve()
    if path.parts[:1] == (STACK_HOME_PREFIX,):
        return ((home or Path(STACK_HOME_PREFIX)) / Path(*path.parts[1:])).resolve()
    return (base / path).resolve()


def config_paths(config: TrainingConfig) -> list[str]:
    """The paths a run reads and writes, one `what: path` each, for `darl train` to say."""
    said = [f"dataset: {config.dataset.path}", f"model: {config.backend.model_dir}"]
    if config.validation.path:
        said.append(f"validation dataset: {config.validation.path}")
    if config.run_dir:
        said.append(f"run dir: {config.run_dir}")
    return said


# Keys the user does not set (continue-as-new fills it in).
HIDDEN_KEYS = {"carried_state"}


def apply_override(data: dict[str, Any], override: str) -> None:
    """`key=value` into the config's data: `total_steps=5`, `knobs.max_inflight=4`. The key
    must be the config's (else ConfigFileError naming the nearest ones); the value is read as
    YAML (`5`, `true`, `[a, b]`, a string) and typed by the model when it validates, except
    for a text field, which takes the text as written (`run_id=42`, `command={python}`)."""
    key, sep, text = override.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigFileError(f"--set {override!r}: expected key=value")
    leaf_type = check_key(key)
    if _is_text(leaf_type) and text.strip() not in ("null", "~"):
        value: Any = text.strip()
    else:
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError as err:
            raise ConfigFileError(f"--set {key}: {single_line(str(err))}") from err
    *parents, leaf = key.split(".")
    node = data
    for i, part in enumerate(parents):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigFileError(f"--set {key}: {'.'.join(parents[: i + 1])} is not a mapping")
        node = child
    node[leaf] = value


def check_key(key: str) -> Any:
    """A dotted key of TrainingConfig; below a field that is not one model (a dict of backend
    settings, a union of agent kinds) any key is left for the model to judge. Returns the
    key's field annotation (None below such a field)."""
    model: type[BaseModel] | None = TrainingConfig
    walked: list[str] = []
    annotation: Any = None
    for part in key.split("."):
        if model is None:
            return None
        fields = {n: f for n, f in model.model_fields.items() if n not in HIDDEN_KEYS}
        if part not in fields:
            raise ConfigFileError(_unknown(".".join([*walked, part]), model, walked))
        walked.append(part)
        annotation = fields[part].annotation
        model = _one_model(annotation)
    if model is not None:
        raise ConfigFileError(
            f"--set {key}: {key} is a section; set one of its keys, e.g. "
            f"{key}.{next(iter(model.model_fields))}"
        )
    return annotation


def _is_text(annotation: Any) -> bool:
    """`str` or `str | None`: a field whose value is the text itself."""
    if annotation is str:
        return True
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return [a for a in typing.get_args(annotation) if a is not type(None)] == [str]
    return False


def config_keys(model: type[BaseModel] = TrainingConfig, prefix: str = "") -> list[str]:
    """Every dotted key of `model`'s fields, nested models included."""
    keys = []
    for name, field in model.model_fields.items():
        if name in HIDDEN_KEYS:
            continue
        nested = _one_model(field.annotation)
        keys.extend(config_keys(nested, f"{prefix}{name}.") if nested else [f"{prefix}{name}"])
    return keys


def _unknown(key: str, model: type[BaseModel], walked: list[str]) -> str:
    prefix = "".join(f"{w}." for w in walked)
    candidates = config_keys(model, prefix)
    close = difflib.get_close_matches(key, candidates, n=1)
    if not close:
        # A misspelt last part still points at its siblings.
        leaf = key.rsplit(".", 1)[-1]
        names = {c.removeprefix(prefix).split(".")[0]: c for c in candidates}
        close = [names[n] for n in difflib.get_close_matches(leaf, list(names), n=1)]
    hint = f"; did you mean {close[0]}?" if close else ""
    return f"--set {key}: no such config key{hint}"


def _one_model(annotation: Any) -> type[BaseModel] | None:
    """The model class a field holds (`Knobs`, `Knobs | None`); None for anything else."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        models = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(models) == 1:
            return _one_model(models[0])
    return None
