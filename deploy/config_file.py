"""A training run's config file: YAML or JSON in, a validated TrainingConfig with absolute
paths out. Used by `darl train`, the demo and the tests alike."""

from __future__ import annotations

from pathlib import Path

import yaml
from pydantic import ValidationError

from darl.deploy.cli_support import one_line, validation_line
from darl.workflows.training_config import TrainingConfig


class ConfigFileError(ValueError):
    """A config file that cannot be read or is not a TrainingConfig; the message is one line."""


def load_config(path: Path, run_id: str | None = None) -> TrainingConfig:
    """A TrainingConfig from YAML or JSON; `run_id` overrides the file's. A file that is not
    one raises ConfigFileError with one line saying what is wrong."""
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as err:
        raise ConfigFileError(f"{path}: {one_line(str(err))}") from err
    if not isinstance(data, dict):
        raise ConfigFileError(f"{path}: expected a mapping of config keys")
    if run_id:
        data["run_id"] = run_id
    try:
        config = TrainingConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigFileError(f"{path}: {validation_line(err)}") from err
    return absolute_paths(config)


def absolute_paths(config: TrainingConfig) -> TrainingConfig:
    """Relative paths in a config mean the directory `darl train` runs in; the workers may
    run elsewhere, so they get absolute ones."""

    def resolved(value: str | None) -> str | None:
        return None if value is None else str(Path(value).expanduser().resolve())

    validation = config.validation
    return config.model_copy(
        update={
            "dataset": config.dataset.model_copy(update={"path": resolved(config.dataset.path)}),
            "validation": validation.model_copy(update={"path": resolved(validation.path)}),
            "backend": config.backend.model_copy(
                update={"model_dir": resolved(config.backend.model_dir)}
            ),
            "run_dir": resolved(config.run_dir),
        }
    )
