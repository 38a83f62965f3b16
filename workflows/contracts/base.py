"""What every contract shares: the frozen pydantic base model, the rollout id's form and the
one workflow id it maps to, and the rollout's mode."""

from __future__ import annotations

from enum import StrEnum

from pydantic import BaseModel, ConfigDict

ROLLOUT_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$"
"""The form of a run id and a rollout id: letters, digits, `.`, `_`, `-`, at most 200
characters, not starting with a punctuation mark. Rollout ids travel in URL paths
(`/rollouts/<id>/v1`) and file names, so they stay URL-safe."""


def rollout_workflow_id(rollout_id: str) -> str:
    """The one workflow id of a rollout: a retried start can never make a second agent."""
    return f"rollout/{rollout_id}"


class Contract(BaseModel):
    """The base of every contract: frozen, and strict about its fields (an unknown field is an
    error, never ignored). Each field's description is the attribute docstring under it, so
    the reference pages and the models' JSON schema say the same."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class RolloutMode(StrEnum):
    """What a rollout is for: `train` rollouts are trained on, `val` rollouts only measured."""

    TRAIN = "train"
    VAL = "val"
