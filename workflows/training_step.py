"""A TrainingWorkflow's steps: step 0, the initial policy put on the policy servers once the
run is checked, and each trained step: train on a batch of complete groups, sync the new
weights, bump the policy version, record the step and start its validation when one is due."""

from __future__ import annotations

from datetime import timedelta

from temporalio import workflow

from darl.workflows.contracts import RolloutMode
from darl.workflows.names import CHECK_RUN, INITIALIZE_POLICY, READ_VAL_TASKS, TRAIN_STEP
from darl.workflows.training_activity_options import (
    HEARTBEAT,
    RETRY_WITHOUT_LIMIT,
    START_RETRY,
    START_TO_CLOSE,
)
from darl.workflows.training_batches import step_record
from darl.workflows.training_messages import (
    InitializeRequest,
    ReadValTasksRequest,
    TrainingPhase,
    TrainStepRequest,
    TrainStepResult,
)
from darl.workflows.training_rollout_starts import start_groups
from darl.workflows.training_run import TrainingRun
from darl.workflows.training_state import TaskRow
from darl.workflows.training_weights import sync_weights


async def initialize(run: TrainingRun) -> None:
    """Check that the run can work at all (its data, reward, agent service, policy servers,
    gateway; a run id trains once), then put step 0 on the policy servers, so every rollout
    of the run knows what it ran."""
    config, state = run.config, run.state
    await workflow.execute_activity(
        CHECK_RUN,
        config,
        start_to_close_timeout=START_TO_CLOSE[CHECK_RUN],
        heartbeat_timeout=HEARTBEAT,
        retry_policy=START_RETRY,
    )
    start = await workflow.execute_activity(
        INITIALIZE_POLICY,
        InitializeRequest(run_id=config.run_id, run_dir=config.run_dir, backend=config.backend),
        result_type=TrainStepResult,
        start_to_close_timeout=START_TO_CLOSE[INITIALIZE_POLICY],
        heartbeat_timeout=HEARTBEAT,
        retry_policy=RETRY_WITHOUT_LIMIT,
    )
    await sync_weights(run, start.policy_path, start.step)
    state.step = state.policy_version = start.step
    state.policy_path = start.policy_path
    state.initialized = True
    run.phase = TrainingPhase.ROLLING_OUT
    run.publish()


async def train_step(run: TrainingRun) -> None:
    """Train the oldest ready groups as the next step, then put its weights on the servers."""
    config, state, book = run.config, run.state, run.book
    run.phase = TrainingPhase.TRAINING
    groups, stats = book.take_batch()
    step = state.step + 1
    trained = await workflow.execute_activity(
        TRAIN_STEP,
        TrainStepRequest(
            run_id=config.run_id,
            run_dir=config.run_dir,
            step=step,
            backend=config.backend,
            aggregation=config.aggregation,
            groups=groups,
            learning_rate=state.knobs.learning_rate,
        ),
        result_type=TrainStepResult,
        start_to_close_timeout=START_TO_CLOSE[TRAIN_STEP],
        # A trainer worker that dies mid-step is noticed by its missing heartbeat; the retry
        # resumes from the last checkpoint and never applies a step twice (rule 5).
        heartbeat_timeout=timedelta(seconds=config.train_heartbeat_seconds),
        retry_policy=RETRY_WITHOUT_LIMIT,
    )
    run.phase = TrainingPhase.SYNCING
    synced = await sync_weights(run, trained.policy_path, step)
    state.step = state.policy_version = step
    state.policy_path = trained.policy_path
    book.drop_stale()
    await run.record_step(step_record(state, step, stats, trained, synced, now=workflow.time()))
    run.phase = TrainingPhase.ROLLING_OUT
    every = config.validation.every_steps
    if every and step % every == 0:
        await _start_validation(run)


async def _start_validation(run: TrainingRun) -> None:
    """Start the rollouts that validate the step just trained: one for each validation task,
    reported into a tally that joins the step's record when the last has reported."""
    run.phase = TrainingPhase.VALIDATING
    rows = await workflow.execute_activity(
        READ_VAL_TASKS,
        ReadValTasksRequest(dataset=run.config.dataset, validation=run.config.validation),
        result_type=list[TaskRow],
        start_to_close_timeout=START_TO_CLOSE[READ_VAL_TASKS],
        heartbeat_timeout=HEARTBEAT,
        retry_policy=RETRY_WITHOUT_LIMIT,
    )
    await start_groups(run, rows, RolloutMode.VAL, 1)
    run.phase = TrainingPhase.ROLLING_OUT
