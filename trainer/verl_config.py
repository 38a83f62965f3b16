"""verl's own configuration for DARL's verl backend: verl's `ppo_trainer` config (composed by
hydra from verl's config folder, as `python -m verl.trainer.main_ppo` does), the user's settings
as verl's dotted keys on top, and validation by verl's own config dataclasses and checks.

A verl user writes `{"actor_rollout_ref.actor.optim.lr": 1e-6, "algorithm.adv_estimator":
"grpo"}` exactly as on verl's command line; a key verl does not have, a value of the wrong type,
or a value verl's checks refuse is a VerlConfigError naming the key.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import io
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import verl
from hydra import compose, initialize_config_dir
from hydra.errors import InstantiationException
from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException
from verl.trainer.config import AlgoConfig
from verl.trainer.ppo import core_algos
from verl.trainer.ppo.utils import need_reference_policy
from verl.utils.config import omega_conf_to_dataclass, validate_config
from verl.workers.config import ActorConfig

from darl.trainer.backend import TrainerBackendError

log = logging.getLogger(__name__)

VERL_CONFIG_DIR = Path(verl.__file__).parent / "trainer" / "config"
VERL_CONFIG_NAME = "ppo_trainer"

# DARL decides these: the model the run starts from and where checkpoints go.
DARL_OWNED_KEYS = {
    "actor_rollout_ref.model.path": "the backend's initial model directory",
    "trainer.default_local_dir": "the backend's checkpoint directory",
}

# Where DARL's defaults differ from verl's: no critic (GRPO), one GPU, micro-batch sizes verl
# leaves unset, and the HF weights in every checkpoint (what the vLLM policy servers load).
DARL_DEFAULTS: dict[str, Any] = {
    "algorithm.adv_estimator": "grpo",
    "critic.enable": False,
    "trainer.n_gpus_per_node": 1,
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 4,
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": 4,
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": 4,
    "actor_rollout_ref.actor.checkpoint.save_contents": ["model", "optimizer", "extra", "hf_model"],
}

# With `trainer.device=cpu` (trainer/verl_cpu_platform.py): FSDP1 wants an accelerator for its
# device_id, flash-attention is CUDA-only, and torch.compile only slows a tiny model down.
CPU_DEFAULTS: dict[str, Any] = {
    "actor_rollout_ref.actor.strategy": "fsdp2",
    "actor_rollout_ref.model.override_config.attn_implementation": "sdpa",
    "actor_rollout_ref.actor.fsdp_config.use_torch_compile": False,
    "actor_rollout_ref.actor.use_torch_compile": False,
}


class VerlConfigError(TrainerBackendError, ValueError):
    """verl settings that verl does not have, or that verl or DARL refuse."""


@dataclass(frozen=True)
class VerlSettings:
    """The validated configuration: `config` is verl's whole `ppo_trainer` config (what verl's
    workers are given), the dataclasses are verl's views of its parts."""

    config: DictConfig
    actor: ActorConfig
    algorithm: AlgoConfig

    @property
    def device(self) -> str:
        return str(self.config.trainer.device)

    @property
    def world_size(self) -> int:
        return int(self.config.trainer.n_gpus_per_node * self.config.trainer.nnodes)

    @property
    def use_reference(self) -> bool:
        """A reference policy is needed (KL loss), as verl decides it."""
        return bool(need_reference_policy(self.config))

    @property
    def bypass_mode(self) -> bool:
        """verl's `algorithm.rollout_correction.bypass_mode`: the rollout's log-probs are the
        behaviour (old) log-probs; otherwise the actor recomputes them before the update."""
        return bool(self.config.algorithm.rollout_correction.bypass_mode)

    @property
    def mini_batch_rows(self) -> int:
        """Rows per actor update: verl's ppo_mini_batch_size counts prompts, times rollout.n."""
        actor = self.config.actor_rollout_ref
        return int(actor.actor.ppo_mini_batch_size * actor.rollout.n)

    @property
    def rows_granule(self) -> int:
        """What every mini-batch's row count must be a multiple of: the world size, times the
        micro-batch sizes when verl splits micro-batches by rows (not use_dynamic_bsz)."""
        actor = self.config.actor_rollout_ref
        if actor.actor.use_dynamic_bsz:
            return self.world_size
        sizes = [
            actor.actor.ppo_micro_batch_size_per_gpu,
            actor.rollout.log_prob_micro_batch_size_per_gpu,
        ]
        if self.use_reference:
            sizes.append(actor.ref.log_prob_micro_batch_size_per_gpu)
        return self.world_size * math.lcm(*(int(size) for size in sizes))

    @property
    def temperature(self) -> float:
        """The sampling temperature log-probs are recomputed at (verl's rollout.temperature)."""
        return float(self.config.actor_rollout_ref.rollout.temperature)


@functools.cache
def _composed_defaults() -> DictConfig:
    with initialize_config_dir(config_dir=str(VERL_CONFIG_DIR), version_base=None):
        return compose(config_name=VERL_CONFIG_NAME)


def verl_defaults() -> DictConfig:
    """verl's `ppo_trainer` config with verl's own defaults (a fresh copy)."""
    config = _composed_defaults().copy()
    OmegaConf.set_struct(config, True)
    return config


def build_verl_config(
    model_dir: Path, overrides: Mapping[str, Any] | None = None, device: str | None = None
) -> VerlSettings:
    """verl's config for training `model_dir`: verl's defaults, then DARL_DEFAULTS (and
    CPU_DEFAULTS when `trainer.device` is "cpu"), then `overrides` in verl's dotted keys; as on
    verl's command line, a key verl's defaults lack is added with a leading "+". `device` is a
    shorthand for the `trainer.device` override. Raises VerlConfigError."""
    config = verl_defaults()
    checked = {_check_key(config, key): value for key, value in (overrides or {}).items()}
    if device is not None:
        checked.setdefault("trainer.device", device)
    layers = [DARL_DEFAULTS]
    if checked.get("trainer.device", config.trainer.device) == "cpu":
        layers.append(CPU_DEFAULTS)
    for layer in [*layers, checked]:
        for key, value in layer.items():
            _set(config, key, value)
    _set(config, "actor_rollout_ref.model.path", str(model_dir))
    if config.algorithm.rollout_correction.bypass_mode:
        # What verl's apply_bypass_mode (rollout_corr_helper.py:1140) does to the config, done
        # before the workers start: they bind the policy loss when they build the actor.
        policy_loss = config.actor_rollout_ref.actor.policy_loss
        with open_dict(policy_loss):
            policy_loss.loss_mode = "bypass_mode"
            policy_loss.rollout_correction = config.algorithm.rollout_correction
    return _validate(config)


def _check_key(config: DictConfig, key: str) -> str:
    """The key without its "+"; VerlConfigError unless verl's config has it (or, with "+",
    has its parent and not the key), or it lies under one of verl's free-form mappings."""
    name = key.removeprefix("+")
    if name in DARL_OWNED_KEYS:
        raise VerlConfigError(f"{name} is set by DARL ({DARL_OWNED_KEYS[name]}), not by a setting")
    exists = _select(config, name) is not _ABSENT
    if key.startswith("+"):
        parent = _select(config, name.rpartition(".")[0]) if "." in name else config
        if exists or not isinstance(parent, DictConfig):
            state = "exists (drop the +)" if exists else "has no parent section in verl's config"
            raise VerlConfigError(f"{key!r}: {name} {state}")
        return name
    if exists or _free_form_parent(config, name) is not None:
        return name
    close = difflib.get_close_matches(name, _all_keys(config), n=1, cutoff=0.8)
    hint = f"; did you mean {close[0]!r}?" if close else " (add a new key with a leading '+')"
    raise VerlConfigError(f"{key!r} is not a setting of verl's ppo_trainer config{hint}")


def _select(config: DictConfig, key: str) -> Any:
    return OmegaConf.select(config, key, default=_ABSENT, throw_on_resolution_failure=False)


_ABSENT = object()


def _free_form_parent(config: DictConfig, key: str) -> str | None:
    """The nearest existing parent of `key` when it is an empty mapping in verl's defaults
    (`model.override_config`, `engine_kwargs`, ...), where verl takes any key."""
    parts = key.split(".")
    for end in range(len(parts) - 1, 0, -1):
        parent = ".".join(parts[:end])
        node = _select(config, parent)
        if node is _ABSENT:
            continue
        return parent if isinstance(node, DictConfig) and len(node) == 0 else None
    return None


def _all_keys(config: DictConfig, prefix: str = "") -> list[str]:
    keys = []
    for name, value in config.items_ex(resolve=False):
        key = f"{prefix}{name!s}"
        keys.append(key)
        if isinstance(value, DictConfig):
            keys += _all_keys(value, f"{key}.")
    return keys


def _set(config: DictConfig, key: str, value: Any) -> None:
    current = OmegaConf.select(config, key, default=None, throw_on_resolution_failure=False)
    _check_type(key, current, value)
    with open_dict(config):  # a free-form parent takes new keys
        OmegaConf.update(config, key, value, merge=False)


def _check_type(key: str, current: Any, value: Any) -> None:
    """A value must have the type of verl's default (an int for a float is fine); keys whose
    default is None or a string interpolation take anything verl's checks then accept."""
    if current is None or value is None:
        return
    for kind, expected, name in _TYPES:
        if isinstance(current, kind):
            wrong_bool = isinstance(value, bool) and bool not in expected
            if wrong_bool or not isinstance(value, expected):
                raise VerlConfigError(
                    f"{key} must be {name} (verl's default is {current!r}), got {value!r}"
                )
            return


# (verl's default is one of these, the values it takes, what to call them); bool before int.
_TYPES: tuple[tuple[type | tuple[type, ...], tuple[type, ...], str], ...] = (
    (bool, (bool,), "a bool"),
    (int, (int,), "an int"),
    (float, (int, float), "a number"),
    (str, (str,), "a string"),
    ((ListConfig, list), (list, tuple, ListConfig), "a list"),
    ((DictConfig, dict), (dict, DictConfig), "a mapping"),
)


def _validate(config: DictConfig) -> VerlSettings:
    """verl's dataclasses and checks, then what DARL's backend does not do."""
    try:
        OmegaConf.resolve(config)
        actor = omega_conf_to_dataclass(config.actor_rollout_ref.actor)
        algorithm = omega_conf_to_dataclass(config.algorithm)
        core_algos.get_adv_estimator_fn(algorithm.adv_estimator)
        core_algos.get_policy_loss_fn(actor.policy_loss.loss_mode)
        with contextlib.redirect_stdout(io.StringIO()) as printed:  # verl prints its verdict
            validate_config(
                config, use_reference_policy=need_reference_policy(config), use_critic=False
            )
        log.debug("verl: %s", printed.getvalue().strip())
    except (InstantiationException, OmegaConfBaseException, ValueError, AssertionError) as err:
        raise VerlConfigError(f"verl refuses the settings: {_cause(err)}") from err
    if config.critic.enable or algorithm.adv_estimator == core_algos.AdvantageEstimator.GAE:
        raise VerlConfigError(
            f"algorithm.adv_estimator={algorithm.adv_estimator} needs a critic; DARL's verl "
            "backend trains none (use grpo, rloo, reinforce_plus_plus, ...)"
        )
    if config.algorithm.use_kl_in_reward:
        raise VerlConfigError(
            "algorithm.use_kl_in_reward is not supported; use actor_rollout_ref.actor.use_kl_loss"
        )
    if config.trainer.device == "cpu" and need_reference_policy(config):
        raise VerlConfigError(
            "the KL loss needs verl's reference worker, which cannot run on CPU: verl builds it "
            "with CPUOffloadPolicy(pin_memory=True) (verl/workers/engine/fsdp/"
            "transformer_impl.py:462), and pinning memory needs an accelerator"
        )
    return VerlSettings(config=config, actor=actor, algorithm=algorithm)


def _cause(err: BaseException) -> str:
    """The innermost message (hydra wraps verl's ValueError in an InstantiationException)."""
    while err.__cause__ is not None:
        err = err.__cause__
    return f"{type(err).__name__}: {err}"
