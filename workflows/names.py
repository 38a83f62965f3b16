"""Every name two processes must agree on, in one place: workflow types, task queues, and the
names of activities, signals, queries, updates and the error types that cross Temporal. The
temporal CLI speaks these too (`temporal workflow start --type TrainingWorkflow
--task-queue darl-trainer`, `temporal workflow signal --name pause`)."""

from __future__ import annotations

# Workflow types.
ROLLOUT_WORKFLOW = "RolloutWorkflow"
TRAINING_WORKFLOW = "TrainingWorkflow"

# Task queues: rollouts on one, the trainer's activities (and the TrainingWorkflow) on the other.
ROLLOUT_TASK_QUEUE = "darl-rollouts"
TRAINER_TASK_QUEUE = "darl-trainer"

# The RolloutWorkflow's activities (rollout worker).
LAUNCH_AGENT = "launch_agent"
AWAIT_AGENT = "await_agent"
COMPUTE_REWARD = "compute_reward"
STOP_AGENT = "stop_agent"
# A local activity: the rollout's report to its trainer, batched with other rollouts' reports.
REPORT_ROLLOUT = "report_rollout"

# The TrainingWorkflow's activities (trainer worker).
CHECK_RUN = "check_run"
INITIALIZE_POLICY = "initialize_policy"
READ_TASKS = "read_tasks"
READ_VAL_TASKS = "read_val_tasks"
START_ROLLOUTS = "start_rollouts"
CANCEL_ROLLOUTS = "cancel_rollouts"
CHECK_ROLLOUTS = "check_rollouts"
TRAIN_STEP = "train_step"
SYNC_WEIGHTS = "sync_weights"
RESTORE_WEIGHTS = "restore_weights"
RECORD_STEP = "record_step"
# A branching group's branch point by surprisal (it reads the seed's records).
CHOOSE_BRANCH_POINT = "choose_branch_point"

# Signals. The gateway sends a rollout its calls and its agent's reports; a rollout tells its
# training run it finished (one result by signal-external, or a worker's batch of results);
# users pause, resume and stop a run.
MODEL_CALLS_SIGNAL = "model_calls"
AGENT_RESULT_SIGNAL = "agent_result"
ROLLOUT_FINISHED_SIGNAL = "rollout_finished"
ROLLOUTS_FINISHED_SIGNAL = "rollouts_finished"
PAUSE_SIGNAL = "pause"
RESUME_SIGNAL = "resume"
STOP_SIGNAL = "stop"

# Queries (`status` on both workflows) and the TrainingWorkflow's update.
STATUS_QUERY = "status"
METRICS_QUERY = "metrics"
UPDATE_KNOBS = "update_knobs"

# ApplicationError types the activities raise that no retry can fix.
AGENT_SPEC_ERROR = "AgentSpecError"
# The rollout's reward cannot work (a function that does not load, a built-in whose task lacks
# the reference answer): bad input, found before any agent runs; the rollout's workflow fails.
REWARD_SPEC_ERROR = "RewardSpecError"
AGENT_LOST_ERROR = "AgentLostError"
# The rollout id already ran in an earlier execution of its workflow id (started again with
# the temporal CLI's default id-reuse policy): its details carry that run's result, if any.
ROLLOUT_ALREADY_RAN_ERROR = "RolloutAlreadyRan"
WRONG_WORKFLOW_ID_ERROR = "WrongWorkflowId"
# A bad dataset or config, a step that does not follow the last one.
TRAINING_CONFIG_ERROR = "TrainingConfigError"
WEIGHT_SYNC_ERROR = "WeightSyncError"
# The TrainingWorkflow's own: a branch point outside its seed's calls (DARL's fault).
BRANCH_POINT_ERROR = "BranchPointError"

# An agent that is a Temporal workflow (`WorkflowAgentSpec`) is started as the rollout's child
# with its attempt in this memo key: `{"base_url", "token", "rollout_id", "attempt"}`, what a
# process agent gets as OPENAI_BASE_URL and OPENAI_API_KEY. DARL's plugin on the agent's worker
# (`darl.temporal_agents`) carries it to the workflow's activities in this header.
AGENT_ATTEMPT_MEMO = "darl_attempt"
AGENT_ATTEMPT_HEADER = "darl-attempt"
