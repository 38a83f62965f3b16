"""Every field a user writes or reads is described where both readers look: the reference
pages (mkdocstrings renders the attribute docstring under a field) and the models' JSON schema
(`use_attribute_docstrings` makes the same docstring the field's `description`)."""

from __future__ import annotations

import inspect
import typing
from collections.abc import Iterator
from types import ModuleType

from pydantic import BaseModel

from darl.workflows import contracts, training_config, training_messages, training_state
from darl.workflows.contracts import Contract, RolloutResult, RolloutSpec
from darl.workflows.training_messages import (
    KnobUpdate,
    StopRequest,
    TrainingConfig,
    TrainingProgress,
    TrainingSummary,
)

ROOTS: list[type[BaseModel]] = [
    RolloutSpec,
    TrainingConfig,
    RolloutResult,
    KnobUpdate,
    StopRequest,
    TrainingProgress,
    TrainingSummary,
]


def models_in(annotation: object) -> Iterator[type[BaseModel]]:
    """The pydantic models an annotation names, through unions, `Annotated`, lists and dicts."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        yield annotation
        return
    for argument in typing.get_args(annotation):
        yield from models_in(argument)


def reachable(roots: list[type[BaseModel]]) -> list[type[BaseModel]]:
    """The public models reachable from `roots` through their fields' annotations."""
    seen: dict[type[BaseModel], None] = {}
    todo = list(roots)
    while todo:
        model = todo.pop()
        if model in seen or model.__name__.startswith("_"):
            continue
        seen[model] = None
        for field in model.model_fields.values():
            todo.extend(models_in(field.annotation))
    return list(seen)


def undescribed(roots: list[type[BaseModel]]) -> list[str]:
    """`Model.field` for each field of a reachable model whose JSON schema has no
    description."""
    missing = []
    for model in reachable(roots):
        properties = model.model_json_schema().get("properties", {})
        for name, schema in properties.items():
            if not str(schema.get("description", "")).strip():
                missing.append(f"{model.__name__}.{name}")
    return missing


def test_every_field_a_user_meets_is_described() -> None:
    models = reachable(ROOTS)
    # The walk reaches the models nested deep: the agent's sandbox limits, the run's state.
    names = {m.__name__ for m in models}
    assert {"SandboxLimits", "GraderSpec", "GroupState", "Counters", "StepRecord"} <= names
    assert undescribed(ROOTS) == []


def defined_in(*modules: ModuleType) -> list[type[BaseModel]]:
    """The public models the modules define (or, for a package, export)."""
    return [
        value
        for module in modules
        for name, value in vars(module).items()
        if not name.startswith("_")
        and inspect.isclass(value)
        and issubclass(value, BaseModel)
        and value.__module__.startswith("darl.")
    ]


def test_every_contract_and_training_message_is_described_too() -> None:
    """The activities' inputs and outputs as well: what a recorded history shows."""
    assert (
        undescribed(defined_in(contracts, training_config, training_state, training_messages)) == []
    )


class Planted(Contract):
    described: int = 0
    """Said."""
    bare: dict[str, int] = {}


class PlantedRoot(Contract):
    inner: list[Planted | None] = []
    """Holds the planted model, two levels down."""


def test_a_planted_model_without_a_description_fails_the_check() -> None:
    assert undescribed([PlantedRoot]) == ["Planted.bare"]
