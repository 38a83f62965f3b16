"""The CPU reference trainer backend: PPO-clip policy-gradient steps on the tiny model, with
advantages, the policy loss and the KL penalty computed by verl's own `core_algos`, AdamW from
torch, and one checkpoint per step (HF model dir + optimizer state + outcome).

Settings use verl's key names; one difference: `ppo_mini_batch_size` counts rows (responses),
not prompts, since a DARL batch's groups need not all have `rollout_n` members.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field
from safetensors.torch import load_file, save_file
from transformers import PreTrainedTokenizerFast, Qwen2ForCausalLM
from verl import DataProto
from verl.trainer.config import AlgoConfig
from verl.trainer.ppo import core_algos
from verl.utils.torch_functional import masked_mean
from verl.workers.config import ActorConfig, PolicyLossConfig

from darl.serving.tiny_model import load_model_dir
from darl.trainer.backend import (
    BatchError,
    CheckpointError,
    CheckpointInfo,
    StepOutcome,
    StepOverrides,
)
from darl.trainer.batch_checks import validate_batch
from darl.trainer.checkpoints import CheckpointedBackend, CheckpointStore
from darl.trainer.shared_prefix import per_row_log_probs, shared_prefix_log_probs
from darl.workflows.heartbeats import Heartbeat

log = logging.getLogger(__name__)

# In a subdirectory: a policy server (vLLM) loads every *.safetensors of a model directory.
OPTIMIZER_TENSORS = "optimizer/state.safetensors"
OPTIMIZER_JSON = "optimizer.json"


class ReferenceTrainerSettings(BaseModel):
    """verl's names and meanings (algorithm.* and actor_rollout_ref.actor.*)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    adv_estimator: Literal["grpo", "rloo", "reinforce_plus_plus"] = "grpo"
    norm_adv_by_std_in_grpo: bool = True
    gamma: float = 1.0  # reinforce_plus_plus's discount
    clip_ratio_low: float = Field(default=0.2, ge=0)
    clip_ratio_high: float = Field(default=0.2, ge=0)
    clip_ratio_c: float = Field(default=3.0, gt=1)
    loss_agg_mode: Literal[
        "token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"
    ] = "token-mean"
    ppo_epochs: int = Field(default=1, ge=1)
    ppo_mini_batch_size: int = Field(default=256, ge=1)  # rows, see the module docstring
    shuffle: bool = False
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = Field(default=0.001, ge=0)
    kl_loss_type: Literal["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"] = "low_var_kl"
    lr: float = Field(default=1e-3, gt=0)
    weight_decay: float = Field(default=0.01, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float = Field(default=1.0, gt=0)
    seed: int = 0
    shared_prefix_min_tokens: int | None = Field(default=None, ge=1)
    """DARL's own: None (the default) runs every row's forward pass whole. n: the rows of one
    group in a mini-batch whose prompts share at least n tokens from their start (a branching
    group's replayed prefix) run over that prefix once (`shared_prefix_log_probs`)."""


class ReferenceBackend(CheckpointedBackend):
    """Trains the model in `initial_model_dir` on CPU, checkpointing under `checkpoint_dir`.
    Not safe for two threads at once; two processes on one directory never publish a step
    twice (the loser reloads the winner's checkpoint)."""

    def __init__(
        self,
        initial_model_dir: Path,
        checkpoint_dir: Path,
        settings: ReferenceTrainerSettings | None = None,
    ) -> None:
        self.initial_model_dir = initial_model_dir
        self.store = CheckpointStore(checkpoint_dir)
        self.settings = settings or ReferenceTrainerSettings()
        self.model: Qwen2ForCausalLM | None = None
        self.tokenizer: PreTrainedTokenizerFast | None = None
        self.optimizer: torch.optim.AdamW | None = None
        self._loaded_step = -1
        self._reference: Qwen2ForCausalLM | None = None

    # --- the TrainerBackend contract -----------------------------------------------------

    @property
    def pad_token_id(self) -> int:
        if self.tokenizer is None:
            raise CheckpointError("initialize() the backend before asking for its pad token")
        return int(self.tokenizer.pad_token_id)

    def initialize(self) -> CheckpointInfo:
        self.store.remove_partial()
        if self.store.latest() < 0:
            model, tokenizer = load_model_dir(self.initial_model_dir)
            outcome = StepOutcome(step=0, metrics={}, checkpoint=self.store.step_dir(0), seconds=0)
            self.store.publish(0, lambda d: self._save(d, model, tokenizer, None, outcome))
        latest = self.store.latest()
        if latest != self._loaded_step:
            self._load(latest)
        return CheckpointInfo(step=latest, path=self.store.step_dir(latest))

    def _publish_step(self, outcome: StepOutcome) -> bool:
        model, tokenizer, optimizer = self._require_loaded()
        return self.store.publish(
            outcome.step, lambda d: self._save(d, model, tokenizer, optimizer, outcome)
        )

    def _load_step(self, step: int) -> None:
        self._load(step)

    def policy_path(self, step: int) -> Path:
        if not self.store.has(step):
            raise CheckpointError(f"no checkpoint for step {step} in {self.store.root}")
        return self.store.step_dir(step)

    def close(self) -> None:
        """Nothing to let go of: the model lives in this process."""

    # --- one step ------------------------------------------------------------------------

    def _prepare(self, step: int, batch: DataProto) -> tuple[int, DataProto]:
        # The step seeds the order of the mini-batches.
        return step, batch

    def _update(
        self, prepared: tuple[int, DataProto], knobs: StepOverrides, heartbeat: Heartbeat
    ) -> dict[str, float]:
        step, batch = prepared
        model, _, optimizer = self._require_loaded()
        data = validate_batch(batch, model.config.vocab_size)
        config = self._actor_config(knobs)
        lr = knobs.lr if knobs.lr is not None else self.settings.lr
        for group in optimizer.param_groups:
            group["lr"] = lr
        advantages = compute_advantages(self.settings, data)
        reference = self._reference_log_probs(data) if config.use_kl_loss else None
        rows = data.batch["responses"].shape[0]
        order_rng = torch.Generator().manual_seed(self.settings.seed * 1_000_003 + step)
        totals: dict[str, list[float]] = {}
        model.train()
        for _ in range(self.settings.ppo_epochs):
            order = torch.randperm(rows, generator=order_rng) if self.settings.shuffle else None
            for start in range(0, rows, self.settings.ppo_mini_batch_size):
                index = torch.arange(start, min(rows, start + self.settings.ppo_mini_batch_size))
                if order is not None:
                    index = order[index]
                for key, value in self._mini_batch(data, advantages, reference, index, config):
                    totals.setdefault(key, []).append(value)
                heartbeat()
        model.eval()
        mask = data.batch["response_mask"].bool()
        scores = data.batch["token_level_rewards"].sum(-1)
        metrics = {key: float(np.mean(values)) for key, values in totals.items()}
        metrics.update(
            {
                "actor/lr": lr,
                "critic/advantages/mean": float(masked_mean(advantages, mask)),
                "critic/advantages/std": float(advantages[mask].std()) if mask.sum() > 1 else 0.0,
                "critic/score/mean": float(scores.mean()),
                "response_length/mean": float(mask.sum(-1).float().mean()),
                "training/rows": float(rows),
            }
        )
        return metrics

    def _mini_batch(
        self,
        data: DataProto,
        advantages: torch.Tensor,
        reference: torch.Tensor | None,
        index: torch.Tensor,
        config: ActorConfig,
    ) -> list[tuple[str, float]]:
        """One optimizer step on rows `index` (verl's ppo_loss, without the padding games)."""
        model, _, optimizer = self._require_loaded()
        mask = data.batch["response_mask"][index].bool()
        log_probs, entropy = self._log_probs(model, data, index, with_entropy=True)
        if entropy is None:
            raise RuntimeError("_log_probs(with_entropy=True) returned no entropy")
        policy_loss_fn = core_algos.get_policy_loss_fn("vanilla")
        pg_loss, pg_metrics = policy_loss_fn(
            old_log_prob=data.batch["old_log_probs"][index].float(),
            log_prob=log_probs,
            advantages=advantages[index],
            response_mask=mask,
            loss_agg_mode=config.loss_agg_mode,
            config=config,
        )
        entropy_loss = core_algos.agg_loss(entropy, mask, config.loss_agg_mode)
        loss = pg_loss - config.entropy_coeff * entropy_loss
        out = [
            ("actor/pg_loss", pg_loss.detach().item()),
            ("actor/entropy", entropy_loss.detach().item()),
        ]
        out += [(key, float(value)) for key, value in pg_metrics.items()]
        if reference is not None:
            # verl annotates torch.FloatTensor, the legacy type no tensor is an instance of.
            kld = core_algos.kl_penalty(
                log_probs,  # type: ignore[arg-type]
                reference[index],  # type: ignore[arg-type]
                config.kl_loss_type,
            )
            kl_loss = core_algos.agg_loss(kld, mask, config.loss_agg_mode)
            loss = loss + config.kl_loss_coef * kl_loss
            out.append(("actor/kl_loss", kl_loss.detach().item()))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), self.settings.grad_clip)
        finite = bool(torch.isfinite(grad_norm))
        if finite:
            optimizer.step()
            out.append(("actor/grad_norm", float(grad_norm)))
        else:
            log.warning("skipping a mini-batch with a non-finite grad norm (%s)", grad_norm)
            optimizer.zero_grad(set_to_none=True)
        out.append(("actor/skipped_mini_batches", float(not finite)))  # the mean: a fraction
        return out

    def _reference_log_probs(self, data: DataProto) -> torch.Tensor:
        """Log-probs under the step-0 model (verl's `ref_log_prob`)."""
        if self._reference is None:
            self._reference = Qwen2ForCausalLM.from_pretrained(
                self.store.step_dir(0), dtype=torch.float32
            ).eval()
        rows = torch.arange(data.batch["responses"].shape[0])
        with torch.no_grad():
            return self._log_probs(self._reference, data, rows, with_entropy=False)[0]

    def _log_probs(
        self, model: Qwen2ForCausalLM, data: DataProto, index: torch.Tensor, with_entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        min_tokens = self.settings.shared_prefix_min_tokens
        if min_tokens is None:
            return per_row_log_probs(model, data, index, with_entropy)
        return shared_prefix_log_probs(model, data, index, with_entropy, min_tokens)

    def _actor_config(self, knobs: StepOverrides) -> ActorConfig:
        s = self.settings
        entropy_coeff = s.entropy_coeff if knobs.entropy_coeff is None else knobs.entropy_coeff
        kl_loss_coef = s.kl_loss_coef if knobs.kl_loss_coef is None else knobs.kl_loss_coef
        return ActorConfig(
            strategy="darl-reference",
            rollout_n=1,
            ppo_mini_batch_size=s.ppo_mini_batch_size,
            ppo_micro_batch_size_per_gpu=s.ppo_mini_batch_size,
            ppo_epochs=s.ppo_epochs,
            clip_ratio_low=s.clip_ratio_low,
            clip_ratio_high=s.clip_ratio_high,
            clip_ratio_c=s.clip_ratio_c,
            loss_agg_mode=s.loss_agg_mode,
            entropy_coeff=entropy_coeff,
            use_kl_loss=s.use_kl_loss,
            kl_loss_coef=kl_loss_coef,
            kl_loss_type=s.kl_loss_type,
            policy_loss=PolicyLossConfig(loss_mode="vanilla"),
        )

    # --- checkpoints ---------------------------------------------------------------------

    def _require_loaded(
        self,
    ) -> tuple[Qwen2ForCausalLM, PreTrainedTokenizerFast, torch.optim.AdamW]:
        if self.model is None or self.tokenizer is None or self.optimizer is None:
            raise CheckpointError("the backend has no model loaded; call initialize()")
        return self.model, self.tokenizer, self.optimizer

    def _new_optimizer(self, model: Qwen2ForCausalLM) -> torch.optim.AdamW:
        s = self.settings
        return torch.optim.AdamW(
            model.parameters(), lr=s.lr, betas=s.betas, weight_decay=s.weight_decay
        )

    def _save(
        self,
        folder: Path,
        model: Qwen2ForCausalLM,
        tokenizer: PreTrainedTokenizerFast,
        optimizer: torch.optim.AdamW | None,
        outcome: StepOutcome,
    ) -> None:
        model.save_pretrained(folder, safe_serialization=True)
        tokenizer.save_pretrained(folder)
        if optimizer is not None:
            tensors, meta = _flatten_optimizer(model, optimizer)
            (folder / OPTIMIZER_TENSORS).parent.mkdir(exist_ok=True)
            save_file(tensors, folder / OPTIMIZER_TENSORS)
            (folder / OPTIMIZER_JSON).write_text(json.dumps(meta, indent=2))
        self.store.write_outcome(folder, outcome)

    def _load(self, step: int) -> None:
        folder = self.store.step_dir(step)
        try:
            model, tokenizer = load_model_dir(folder)
        except (OSError, ValueError) as err:
            raise CheckpointError(f"cannot load the model of step {step}: {err}") from err
        optimizer = self._new_optimizer(model)
        if (folder / OPTIMIZER_JSON).exists():
            meta = json.loads((folder / OPTIMIZER_JSON).read_text())
            _restore_optimizer(model, optimizer, load_file(folder / OPTIMIZER_TENSORS), meta)
        self.model, self.tokenizer, self.optimizer = model, tokenizer, optimizer
        self._loaded_step = step


def _flatten_optimizer(
    model: Qwen2ForCausalLM, optimizer: torch.optim.AdamW
) -> tuple[dict[str, torch.Tensor], dict[str, object]]:
    """AdamW's state keyed by parameter name: tensors for safetensors, the rest for JSON."""
    tensors: dict[str, torch.Tensor] = {}
    steps: dict[str, float] = {}
    for name, param in model.named_parameters():
        state = optimizer.state.get(param, {})
        for key, value in state.items():
            if key == "step":
                steps[name] = float(value)
            else:
                tensors[f"{name}.{key}"] = value.detach().contiguous()
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    return tensors, {"param_groups": groups, "steps": steps}


def _restore_optimizer(
    model: Qwen2ForCausalLM,
    optimizer: torch.optim.AdamW,
    tensors: dict[str, torch.Tensor],
    meta: dict,
) -> None:
    names = [name for name, _ in model.named_parameters()]
    state: dict[int, dict[str, torch.Tensor]] = {}
    for i, name in enumerate(names):
        if name not in meta["steps"]:
            continue
        state[i] = {"step": torch.tensor(meta["steps"][name], dtype=torch.float32)}
        for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            if f"{name}.{key}" in tensors:
                state[i][key] = tensors[f"{name}.{key}"]
    groups = meta["param_groups"]
    if len(groups) != 1:
        raise CheckpointError(f"expected one optimizer param group, found {len(groups)}")
    for group in groups:
        if isinstance(group.get("betas"), list):
            group["betas"] = tuple(group["betas"])
    optimizer.load_state_dict(
        {"state": state, "param_groups": [{**groups[0], "params": list(range(len(names)))}]}
    )


def compute_advantages(settings: ReferenceTrainerSettings, data: DataProto) -> torch.Tensor:
    """verl's advantage estimator, called as verl's `compute_advantage` calls it (the viewer
    shows a group's advantages with it too)."""
    estimator = core_algos.get_adv_estimator_fn(settings.adv_estimator)
    kwargs: dict[str, object] = {
        "token_level_rewards": data.batch["token_level_rewards"].float(),
        "response_mask": data.batch["response_mask"].float(),
        "config": AlgoConfig(
            gamma=settings.gamma,
            adv_estimator=settings.adv_estimator,
            norm_adv_by_std_in_grpo=settings.norm_adv_by_std_in_grpo,
        ),
    }
    if settings.adv_estimator in ("grpo", "rloo"):
        if "uid" not in data.non_tensor_batch:
            raise BatchError(f"{settings.adv_estimator} needs the group ids `uid`")
        kwargs["index"] = data.non_tensor_batch["uid"]
    if settings.adv_estimator == "grpo":
        kwargs["norm_adv_by_std_in_grpo"] = settings.norm_adv_by_std_in_grpo
    advantages, _ = estimator(**kwargs)
    return advantages.detach()
