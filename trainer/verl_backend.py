"""DARL's verl trainer backend: verl 0.9.1's own actor and reference workers (the FSDP engine of
verl/workers/engine_workers.py) in a Ray worker group, driven per step as verl's RayPPOTrainer
drives them, with one verl checkpoint per step in DARL's checkpoint layout.

Per step: old log-probs (recomputed by the actor, verl's default; or the rollout's, with verl's
`algorithm.rollout_correction.bypass_mode=true`), reference log-probs when the KL loss is on,
advantages by verl's `compute_advantage`, `update_actor` (verl's `ppo_loss`), then verl's
checkpoint manager writes `step-N/actor/` with the HF model in `actor/huggingface/` (what
`policy_path(step)` returns and a vLLM server loads).

Not run on a GPU. It runs end to end on CPU only, through Ray, on trainer/verl_cpu_platform.py
(world size 1, gloo, FSDP2, sdpa). Unreachable on CPU: the reference worker (verl pins its
memory, transformer_impl.py:462), FSDP1 (transformer_impl.py:441 wants an accelerator device),
flash attention, NCCL and more than one rank. Heartbeats come every HEARTBEAT_SECONDS while a
worker call runs (verl's update runs all mini-batches in one call).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from functools import partial
from pathlib import Path
from typing import Any, TypeVar, cast

import ray
import torch.distributed as dist
from omegaconf import OmegaConf
from ray.exceptions import RayActorError
from transformers import AutoConfig, AutoTokenizer
from verl import DataProto
from verl.single_controller.base.decorator import Dispatch, register
from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
from verl.single_controller.ray.base import create_colocated_worker_cls
from verl.trainer.constants_ppo import get_ppo_ray_runtime_env
from verl.trainer.ppo.core_algos import agg_loss
from verl.trainer.ppo.metric_utils import compute_data_metrics
from verl.trainer.ppo.ray_trainer import compute_advantage
from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_add_to_batch
from verl.utils.debug.metrics import calculate_debug_metrics
from verl.utils.device import get_device_name
from verl.workers.engine_workers import ActorRolloutRefWorker
from verl.workers.utils.losses import ppo_loss

from darl.trainer.backend import (
    CheckpointError,
    CheckpointInfo,
    StepOutcome,
    StepOverrides,
)
from darl.trainer.checkpoints import CheckpointedBackend, CheckpointStore
from darl.trainer.verl_batch import (
    PreparedBatch,
    actor_metrics,
    prepare_batch,
    worker_input,
    worker_output,
)
from darl.trainer.verl_config import VerlSettings
from darl.workflows.heartbeats import Heartbeat

log = logging.getLogger(__name__)

ACTOR_DIR = "actor"
HF_DIR = "huggingface"  # where verl's checkpoint manager writes the HF model (hf_model)
HEARTBEAT_SECONDS = 10.0

T = TypeVar("T")


class DarlActorWorker(ActorRolloutRefWorker):
    """verl's worker plus what DARL needs: a gloo process group on CPU and per-step knobs."""

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        # On CPU verl would ask for "cpu:gloo,cpu:gloo" (verl/utils/distributed.py:89).
        if get_device_name() == "cpu" and not dist.is_initialized():
            dist.init_process_group("gloo")
        super().init_model()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def set_step_knobs(
        self, lr: float, entropy_coeff: float | None, kl_loss_coef: float | None
    ) -> None:
        """The learning rate of the next update (kept under verl's LR schedule) and loss
        coefficients; None restores the configured coefficient."""
        engine = self.actor.engine
        scheduler = engine.lr_scheduler
        groups = engine.optimizer.param_groups
        scheduler.base_lrs = [lr] * len(groups)
        lambdas = getattr(scheduler, "lr_lambdas", [lambda _: 1.0] * len(groups))
        for group, factor in zip(groups, lambdas, strict=True):
            group["lr"] = lr * factor(scheduler.last_epoch)
        changes = {"entropy_coeff": entropy_coeff, "kl_loss_coef": kl_loss_coef}
        configured = self.loss_fn.keywords["config"]
        config = dataclasses.replace(
            configured, **{k: v for k, v in changes.items() if v is not None}
        )
        self.actor.set_loss_fn(partial(ppo_loss, config=config))


# --- the backend ---------------------------------------------------------------------------


class VerlBackend(CheckpointedBackend):
    """Trains `initial_model_dir` with verl's workers, checkpointing under `checkpoint_dir`.
    Holds a Ray worker group (and starts Ray when none is running): call `close()` when done.
    Not safe for two threads at once; two processes on one directory never publish a step
    twice (the loser loads the winner's checkpoint). Resuming needs the same world size:
    verl's FSDP checkpoint is one file per rank."""

    def __init__(self, initial_model_dir: Path, checkpoint_dir: Path, settings: VerlSettings):
        self.initial_model_dir = initial_model_dir
        self.store = CheckpointStore(checkpoint_dir)
        self.settings = settings
        self.vocab_size = int(AutoConfig.from_pretrained(initial_model_dir).vocab_size)
        pad = AutoTokenizer.from_pretrained(initial_model_dir).pad_token_id
        if pad is None:
            raise CheckpointError(f"the tokenizer in {initial_model_dir} has no pad token")
        self.pad_token_id = int(pad)
        self._actor: RayWorkerGroup | None = None
        self._ref: RayWorkerGroup | None = None
        self._started_ray = False
        self._loaded_step = -1
        self._calls: ThreadPoolExecutor | None = None

    # --- the TrainerBackend contract -----------------------------------------------------

    def initialize(self) -> CheckpointInfo:
        self.store.remove_partial()
        actor = self._workers()
        if self.store.latest() < 0:
            outcome = StepOutcome(step=0, metrics={}, checkpoint=self.store.step_dir(0), seconds=0)
            if self._publish(actor, outcome):
                self._loaded_step = 0
        latest = self.store.latest()
        if latest != self._loaded_step:
            self._load(actor, latest)
        return CheckpointInfo(step=latest, path=self.policy_path(latest))

    def _prepare(self, step: int, batch: DataProto) -> PreparedBatch:
        return prepare_batch(batch, self.settings, self.vocab_size, seed=step)

    def _update_failed(self, err: BaseException) -> None:
        if isinstance(err, RayActorError):
            self._drop_workers()  # a lost worker: start fresh ones from the checkpoint
        else:
            self._loaded_step = -1  # the actor may be half updated: reload it before a retry

    def _publish_step(self, outcome: StepOutcome) -> bool:
        return self._publish(self._workers(), outcome)

    def _load_step(self, step: int) -> None:
        self._load(self._workers(), step)

    def policy_path(self, step: int) -> Path:
        path = self.store.step_dir(step) / ACTOR_DIR / HF_DIR
        if not self.store.has(step) or not path.is_dir():
            raise CheckpointError(f"no HF model for step {step} in {self.store.root}")
        return path

    def close(self) -> None:
        """Stop the workers (and Ray, when this backend started it)."""
        self._drop_workers()
        if self._calls is not None:
            self._calls.shutdown(wait=False)
            self._calls = None
        if self._started_ray:
            ray.shutdown()
            self._started_ray = False

    def __enter__(self) -> VerlBackend:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    # --- one step, as verl's RayPPOTrainer.fit runs it ------------------------------------

    def _update(
        self, prepared: PreparedBatch, knobs: StepOverrides, heartbeat: Heartbeat
    ) -> dict[str, float]:
        settings, data, actor = self.settings, prepared.data, self._workers()
        lr = knobs.lr if knobs.lr is not None else float(settings.actor.optim.lr)
        actor.set_step_knobs(lr, knobs.entropy_coeff, knobs.kl_loss_coef)
        metrics: dict[str, float] = {}
        if not settings.bypass_mode:
            metrics.update(self._recompute_old_log_probs(data, heartbeat))
            if settings.config.algorithm.rollout_correction.get("rollout_is") or (
                settings.config.algorithm.rollout_correction.get("rollout_rs")
            ):
                data, corrections = compute_rollout_correction_and_add_to_batch(
                    data, settings.config.algorithm.rollout_correction
                )
                metrics.update(corrections)
        if self._ref is not None:
            sent = worker_input(
                data, calculate_entropy=False, compute_loss=False, temperature=settings.temperature
            )
            output = self._call(heartbeat, self._ref.compute_ref_log_prob, sent)
            data.batch["ref_log_prob"] = worker_output(output, sent, "log_probs")
        data = compute_advantage(
            data,
            # verl takes the estimator's name as its configs spell it (it is a str enum).
            adv_estimator=settings.algorithm.adv_estimator,  # type: ignore[arg-type]
            gamma=settings.algorithm.gamma,
            lam=settings.algorithm.lam,
            num_repeat=settings.config.actor_rollout_ref.rollout.n,
            norm_adv_by_std_in_grpo=settings.algorithm.norm_adv_by_std_in_grpo,
            config=settings.algorithm,
        )
        actor_config = settings.config.actor_rollout_ref.actor
        entropy_coeff = (
            actor_config.entropy_coeff if knobs.entropy_coeff is None else knobs.entropy_coeff
        )
        sent = worker_input(
            data,
            calculate_entropy=actor_config.calculate_entropy or entropy_coeff != 0,
            distillation_use_topk=False,
            distillation_only=False,
            global_batch_size=prepared.mini_batch_rows,
            mini_batch_size=prepared.mini_batch_rows,
            epochs=actor_config.ppo_epochs,
            seed=actor_config.data_loader_seed,
            dataloader_kwargs={"shuffle": False},  # prepare_batch shuffled
            compute_loss=True,
            temperature=settings.temperature,
        )
        metrics.update(actor_metrics(self._call(heartbeat, actor.update_actor, sent)))
        real = data.select_idxs(prepared.real)
        metrics.update(compute_data_metrics(real, use_critic=False))
        metrics["actor/lr_requested"] = lr
        metrics["training/rows"] = float(prepared.rows)
        metrics["training/padding_rows"] = float(len(prepared.real) - prepared.rows)
        return {key: float(value) for key, value in metrics.items()}

    def _recompute_old_log_probs(self, data: DataProto, heartbeat: Heartbeat) -> dict[str, Any]:
        """verl's decoupled mode: the actor's log-probs before the update are the old ones."""
        actor_config = self.settings.config.actor_rollout_ref.actor
        sent = worker_input(
            data, calculate_entropy=True, compute_loss=False, temperature=self.settings.temperature
        )
        output = self._call(heartbeat, self._workers().compute_log_prob, sent)
        data.batch["old_log_probs"] = worker_output(output, sent, "log_probs")
        entropy = agg_loss(
            loss_mat=worker_output(output, sent, "entropy"),
            loss_mask=data.batch["response_mask"],
            loss_agg_mode=actor_config.loss_agg_mode,
            loss_scale_factor=actor_config.loss_scale_factor,
        )
        metrics: dict[str, Any] = {"actor/entropy": entropy.item()}
        if "rollout_log_probs" in data.batch:
            metrics.update(calculate_debug_metrics(data))  # rollout vs actor probabilities
        return metrics

    def _call(self, heartbeat: Heartbeat, method: Callable[..., T], *args: Any) -> T:
        """A blocking worker call, heartbeating from this thread while it runs."""
        if self._calls is None:
            self._calls = ThreadPoolExecutor(max_workers=1, thread_name_prefix="verl-call")
        future = self._calls.submit(method, *args)
        while True:
            try:
                return future.result(timeout=HEARTBEAT_SECONDS)
            except FutureTimeout:
                heartbeat()

    # --- workers and checkpoints ---------------------------------------------------------

    def _workers(self) -> RayWorkerGroup:
        """The actor worker group, started on first use (the reference group beside it)."""
        if self._actor is not None:
            return self._actor
        config = self.settings.config
        cpu = self.settings.device == "cpu"
        if not ray.is_initialized():
            ray.init(**_ray_init_kwargs(self.settings))
            self._started_ray = True
        pool = RayResourcePool(
            [config.trainer.n_gpus_per_node] * config.trainer.nnodes,
            use_gpu=not cpu,
            max_colocate_count=1,
        )
        remote = ray.remote(DarlActorWorker)
        roles = ["actor", "ref"] if self.settings.use_reference else ["actor"]
        classes = {
            role: RayClassWithInitArgs(cls=remote, config=config.actor_rollout_ref, role=role)
            for role in roles
        }
        group = RayWorkerGroup(
            resource_pool=pool,
            ray_cls_with_init=create_colocated_worker_cls(classes),
            device_name=get_device_name(),
            worker_env=_worker_env(cpu),
        )
        groups = group.spawn(prefix_set=classes.keys())
        for role in roles:
            groups[role].init_model()
        self._actor, self._ref = groups["actor"], groups.get("ref")
        return self._actor

    def _drop_workers(self) -> None:
        for group in (self._actor, self._ref):
            for worker in group.workers if group is not None else []:
                ray.kill(worker)
        self._actor = self._ref = None
        self._loaded_step = -1

    def _publish(self, actor: RayWorkerGroup, outcome: StepOutcome) -> bool:
        def write(folder: Path) -> None:
            actor.save_checkpoint(str(folder / ACTOR_DIR), None, outcome.step, None)
            self.store.write_outcome(folder, outcome)

        return self.store.publish(outcome.step, write)

    def _load(self, actor: RayWorkerGroup, step: int) -> None:
        folder = self.store.step_dir(step) / ACTOR_DIR
        if not folder.is_dir():
            raise CheckpointError(f"step {step} holds no verl actor checkpoint at {folder}")
        actor.load_checkpoint(str(folder), None, False)
        self._loaded_step = step


def _worker_env(cpu: bool) -> dict[str, str]:
    if not cpu:
        return {}
    from darl.trainer.verl_cpu_platform import WORKER_ENV

    return dict(WORKER_ENV)


def _ray_init_kwargs(settings: VerlSettings) -> dict[str, Any]:
    """verl's `ray_kwargs.ray_init` over verl's PPO runtime env, as verl's main_ppo starts Ray."""
    init = cast(
        dict[str, Any], OmegaConf.to_container(settings.config.ray_kwargs.ray_init, resolve=True)
    )
    runtime_env = OmegaConf.merge(get_ppo_ray_runtime_env(settings.config), init.pop("runtime_env"))
    return {**init, "runtime_env": OmegaConf.to_container(runtime_env)}
