"""Which trainer backend a run's `backend` spec names, built with its settings: `reference`
(CPU, the tiny model) or `verl` (verl's own workers through Ray; imported only when asked for,
since it starts Ray)."""

from __future__ import annotations

from pathlib import Path

from darl.trainer.backend import TrainerBackend
from darl.trainer.reference_backend import ReferenceBackend, ReferenceTrainerSettings
from darl.workflows.training_config import BackendSpec


def make_backend(spec: BackendSpec, checkpoint_dir: Path) -> TrainerBackend:
    """The backend for `spec`, checkpointing under `checkpoint_dir`. Raises ValueError (or a
    subclass) for settings the backend does not have or refuses."""
    model_dir = Path(spec.model_dir)
    if spec.name == "verl":
        from darl.trainer.verl_backend import VerlBackend
        from darl.trainer.verl_config import build_verl_config

        return VerlBackend(model_dir, checkpoint_dir, build_verl_config(model_dir, spec.settings))
    return ReferenceBackend(model_dir, checkpoint_dir, ReferenceTrainerSettings(**spec.settings))
