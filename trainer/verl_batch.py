"""DARL's training batch on its way to verl's workers: checked, laid out in whole mini-batches
and micro-batches per rank (padding rows that train nothing), and converted to and from the
no-padding TensorDicts verl's FSDP engine takes, as verl's RayPPOTrainer converts them."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict
from verl import DataProto
from verl.utils import tensordict_utils as tu
from verl.utils.metric import reduce_metrics
from verl.utils.py_functional import rename_dict
from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding

from darl.trainer.backend import BatchError
from darl.trainer.batch_checks import validate_batch
from darl.trainer.verl_config import VerlSettings

PADDING_UID = "darl-padding"


@dataclass(frozen=True)
class PreparedBatch:
    """The batch laid out for the workers: `mini_batch_rows` divides its length, each
    mini-batch holds real rows, and `real` marks them (the others are padding)."""

    data: DataProto
    real: np.ndarray
    mini_batch_rows: int

    @property
    def rows(self) -> int:
        return int(self.real.sum())


def prepare_batch(
    batch: DataProto, settings: VerlSettings, vocab_size: int, seed: int = 0
) -> PreparedBatch:
    """The rows verl trains on, checked (BatchError), in bypass mode with the rollout's
    log-probs as old log-probs, and laid out in whole mini-batches and micro-batches per rank.

    verl's mini-batch is ppo_mini_batch_size * rollout.n rows; a DARL batch need not be a
    multiple, so it is split into ceil(rows / that) mini-batches of equal length, a multiple
    of `settings.rows_granule`, each filled up with padding rows: row 0's tokens with no
    trained token, no reward and a group of their own, so they change no advantage and no
    token-mean loss (a seq-mean loss counts them as sequences). With verl's `actor.shuffle` the
    rows are shuffled here (by `seed`), once per step, and verl is told not to shuffle: its
    shuffle could gather a mini-batch of padding only, whose token-mean loss is 0/0."""
    data = validate_batch(batch, vocab_size)
    if "uid" not in data.non_tensor_batch:
        raise BatchError("the batch lacks the group ids `uid`")
    prompt_width = data.batch["prompts"].shape[1]
    if not data.batch["attention_mask"][:, :prompt_width].any(dim=1).all():
        raise BatchError(
            "every row needs a prompt token (verl reads the first response token's "
            "log-prob at the last prompt position)"
        )
    tensors = {key: value.clone() for key, value in data.batch.items()}
    tensors.setdefault("token_level_scores", tensors["token_level_rewards"].clone())
    if settings.bypass_mode:
        if "rollout_log_probs" not in tensors:
            raise BatchError("bypass_mode needs rollout_log_probs in the batch")
        tensors["old_log_probs"] = tensors["rollout_log_probs"].clone()
    rows = tensors["responses"].shape[0]
    order = torch.arange(rows)
    if settings.config.actor_rollout_ref.actor.shuffle:
        order = torch.randperm(rows, generator=torch.Generator().manual_seed(seed))
    count = math.ceil(rows / settings.mini_batch_rows)
    granule = settings.rows_granule
    per_mini_batch = math.ceil(math.ceil(rows / count) / granule) * granule
    index, real = [], []
    for j in range(count):
        part = order[j * rows // count : (j + 1) * rows // count].tolist()
        index += part + [0] * (per_mini_batch - len(part))
        real += [True] * len(part) + [False] * (per_mini_batch - len(part))
    is_real = torch.tensor(real)
    laid_out = {key: value[index] for key, value in tensors.items()}
    for key in ("response_mask", "token_level_rewards", "token_level_scores"):
        laid_out[key][~is_real] = 0
    uids = data.non_tensor_batch["uid"][index].copy()
    uids[~is_real.numpy()] = [f"{PADDING_UID}-{i}" for i in range(int((~is_real).sum()))]
    prepared = DataProto.from_dict(tensors=laid_out, non_tensors={"uid": uids})
    return PreparedBatch(prepared, real=is_real.numpy(), mini_batch_rows=per_mini_batch)


def worker_input(data: DataProto, **meta: Any) -> TensorDict:
    """A padded batch as verl's workers take it: no padding (nested tensors) and metadata."""
    td = left_right_2_no_padding(data.to_tensordict())
    tu.assign_non_tensor(td, **meta)
    return td


def worker_output(output: TensorDict, sent: TensorDict, key: str) -> torch.Tensor:
    """A per-token output of a worker as a padded [rows, response] float tensor."""
    return no_padding_2_padding(tu.get(output, key), sent).float()


def actor_metrics(output: TensorDict) -> dict[str, float]:
    """update_actor's metrics named and reduced as verl's trainer does."""
    metrics = rename_dict(tu.get(output, "metrics"), "actor/")
    metrics["perf/mfu/actor"] = metrics.pop("actor/mfu", 0.0)
    return {key: float(value) for key, value in reduce_metrics(metrics).items()}
