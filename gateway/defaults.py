"""The gateway's defaults, in one place: its settings classes take them, and so do the `darl
gateway` flags that set them (a module with no imports, so the CLI reads it at no cost)."""

# The largest request body an agent or the admin API may send.
MAX_BODY_BYTES = 8 * 1024 * 1024
# How long one model call may take, retries included.
CALL_DEADLINE_SECONDS = 600.0
# How long a call waits for a policy server that serves older weights than the run's.
STALE_WAIT_SECONDS = 120.0
# How often a rollout's captured calls go to its workflow (one batched signal).
SIGNAL_INTERVAL_SECONDS = 1.0
# This gateway's name among those sharing a journal.
INSTANCE = "gateway"
# The sampling temperature forced on training calls and on validation calls.
TRAIN_TEMPERATURE = 1.0
VAL_TEMPERATURE = 0.7
