"""The policy's steps on the trainer: step 0 from the initial model, a training step from its
rollouts' committed calls in the store (idempotent per checkpoint, rule 5), the weights synced
to (or restored on) the policy servers, a branching group's branch point, the run's files."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import statistics
from pathlib import Path

from temporalio import activity

from darl.activities.errors import (
    training_config_error,
    trajectory_lost_error,
    weight_sync_error,
)
from darl.activities.heartbeats import heartbeats_throughout
from darl.activities.trainer_resources import HEARTBEAT_SECONDS, TrainerResources
from darl.gateway.store.record import CallRecord
from darl.trainer import run_files
from darl.trainer.aggregation import AggregationSettings, RolloutSample, aggregate
from darl.trainer.backend import StepOverrides, TrainerBackendError
from darl.trainer.gateway_replicas import GatewayReplicas
from darl.trainer.policy_control import (
    WeightSyncError,
    policy_server_control,
    restore_weights,
    sync_weights,
)
from darl.workflows.names import (
    CHOOSE_BRANCH_POINT,
    INITIALIZE_POLICY,
    RECORD_STEP,
    RESTORE_WEIGHTS,
    SYNC_WEIGHTS,
    TRAIN_STEP,
)
from darl.workflows.training_config import GroupsSpec
from darl.workflows.training_messages import (
    BranchPoint,
    BranchPointRequest,
    InitializeRequest,
    RecordStepRequest,
    RestoreResult,
    SyncRequest,
    SyncResult,
    TrainStepRequest,
    TrainStepResult,
)

log = logging.getLogger(__name__)


def committed_calls(
    records: list[CallRecord], rollout_id: str, calls: int, digest: str
) -> list[CallRecord]:
    """The calls a rollout's final attempt committed, from all its attempt's `records`: the
    first `calls` by sequence (a call recorded after the attempt's close comes after them) of
    those its agent received (an answer it never received is no part of its trajectory),
    checked against `digest`, the SHA-256 of their ids (`RolloutOutcome.events_digest`).
    KeyError when the store's record is not what the rollout committed."""
    received = (r for r in records if not r.unreceived)
    taken = sorted(received, key=lambda r: r.sequence)[:calls]
    found = hashlib.sha256("\n".join(r.call_id for r in taken).encode()).hexdigest()
    if len(taken) < calls or found != digest:
        raise KeyError(
            f"the store's record of {rollout_id} ({len(records)} calls) is not the {calls} "
            "calls its final attempt committed"
        )
    return taken


def surprisal(record: CallRecord) -> float:
    """The mean -logprob of a call's sampled tokens (an entropy proxy); 0.0 for a call that
    sampled none or came back without logprobs."""
    logprobs = record.completion_logprobs()
    return -statistics.fmean(logprobs) if logprobs else 0.0


class PolicyStepActivities(TrainerResources):
    """initialize_policy, train_step, sync_weights, restore_weights, choose_branch_point,
    record_step."""

    @activity.defn(name=INITIALIZE_POLICY)
    @heartbeats_throughout(HEARTBEAT_SECONDS)
    async def initialize_policy(self, request: InitializeRequest) -> TrainStepResult:
        """Step 0 from the initial model (a run whose checkpoints went further was refused by
        check_run; a retry after a crash finds step 0 saved)."""
        backend = self._backend(request.run_id, request.run_dir, request.backend)
        model_dir = Path(request.backend.model_dir)
        if not await asyncio.to_thread(model_dir.is_dir):
            raise training_config_error(f"model_dir {model_dir} is not a model directory")
        info = await asyncio.to_thread(backend.initialize)
        return TrainStepResult(
            step=info.step, policy_path=str(backend.policy_path(info.step)), metrics={}, seconds=0
        )

    @activity.defn(name=TRAIN_STEP)
    @heartbeats_throughout(HEARTBEAT_SECONDS)
    async def train_step(self, request: TrainStepRequest) -> TrainStepResult:
        """Idempotent per step (rule 5): a step already checkpointed is returned as it was;
        after a crash the retry trains from the last checkpoint. Heartbeats throughout."""
        backend = self._backend(request.run_id, request.run_dir, request.backend)

        def train() -> TrainStepResult:
            with self._train_lock:
                backend.initialize()
                settings = AggregationSettings(
                    **request.aggregation.model_dump(), pad_token_id=backend.pad_token_id
                )
                batch, counters = aggregate(self._samples(request), settings)
                done = backend.train_step(
                    request.step, batch, StepOverrides(lr=request.learning_rate)
                )
            aggregated = {f"aggregation/{k}": float(v) for k, v in counters.as_dict().items()}
            return TrainStepResult(
                step=done.step,
                policy_path=str(backend.policy_path(done.step)),
                metrics={**done.metrics, **aggregated},
                seconds=done.seconds,
            )

        try:
            return await asyncio.to_thread(train)
        except (ValueError, TrainerBackendError) as err:
            # A batch no step can use, a step out of order: retrying cannot fix either.
            raise training_config_error(f"step {request.step}: {err}") from err
        except KeyError as err:
            # A member's calls are not in the store as its rollout committed them: lost.
            raise trajectory_lost_error(f"step {request.step}: {err.args[0]}") from err

    def _samples(self, request: TrainStepRequest) -> list[RolloutSample]:
        samples = []
        for group in request.groups:
            for member in group.members:
                records = self._store.read_sync(
                    member.rollout_id, attempt=member.attempt, call_ids=member.call_ids
                )
                if member.call_ids is None:
                    records = committed_calls(
                        records, member.rollout_id, member.calls, member.digest
                    )
                samples.append(
                    RolloutSample(
                        rollout_id=member.rollout_id,
                        group_id=group.group_id,
                        reward=member.reward,
                        records=records,
                        masked_calls=member.masked_calls,
                    )
                )
        return samples

    @activity.defn(name=SYNC_WEIGHTS)
    @heartbeats_throughout(HEARTBEAT_SECONDS)
    async def sync_weights(self, request: SyncRequest) -> SyncResult:
        settings = request.weight_sync
        gateway = GatewayReplicas(settings.admin_urls, self._admin_key, self._http)
        servers = [policy_server_control(spec, self._http) for spec in settings.policy_servers]
        try:
            outcome = await sync_weights(
                gateway,
                servers,
                request.policy_path,
                request.policy_version,
                settings.inflight,
                settings.drain_timeout_seconds,
                pause_mode=settings.pause_mode,
                register_upstreams=settings.register_upstreams,
            )
        except WeightSyncError as err:
            raise weight_sync_error(str(err)) from err
        return SyncResult(paused_seconds=outcome.paused_seconds, drained=outcome.drained)

    @activity.defn(name=RESTORE_WEIGHTS)
    @heartbeats_throughout(HEARTBEAT_SECONDS)
    async def restore_weights(self, request: SyncRequest) -> RestoreResult:
        """Between syncs: load the run's weights again on a policy server that lost them."""
        servers = [
            policy_server_control(spec, self._http) for spec in request.weight_sync.policy_servers
        ]
        try:
            restored = await restore_weights(servers, request.policy_path, request.policy_version)
        except WeightSyncError as err:
            raise weight_sync_error(str(err)) from err
        return RestoreResult(restored=restored)

    @activity.defn(name=CHOOSE_BRANCH_POINT)
    @heartbeats_throughout(HEARTBEAT_SECONDS)
    async def choose_branch_point(self, request: BranchPointRequest) -> BranchPoint:
        """A branching group's branch point under `branch_at: surprisal`, from its seed's
        committed calls in the store (`GroupsSpec.highest_surprisal`); None when it has fewer
        than two, or the store lacks some (no prefix the gateway could replay). Reads only."""
        try:
            records = await self._store.read(
                request.rollout_id, attempt=request.attempt, call_ids=request.call_ids
            )
            if request.call_ids is None:
                records = committed_calls(
                    records, request.rollout_id, request.calls, request.digest
                )
        except KeyError as err:
            log.warning("seed %s cannot branch: %s", request.rollout_id, err)
            return BranchPoint(at=None, surprisal=[])
        figures = [surprisal(record) for record in records]
        if len(figures) < 2:
            return BranchPoint(at=None, surprisal=figures)
        return BranchPoint(at=GroupsSpec.highest_surprisal(figures), surprisal=figures)

    # --- the run's files ---------------------------------------------------------------------

    @activity.defn(name=RECORD_STEP)
    @heartbeats_throughout(HEARTBEAT_SECONDS)
    async def record_step(self, request: RecordStepRequest) -> None:
        run_dir = self.run_dir(request.run_id, request.run_dir)

        def write() -> None:
            run_files.write_step(run_dir, request.record.model_dump())
            run_files.plot_rewards(run_dir, request.run_id)

        await asyncio.to_thread(write)
