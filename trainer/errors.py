"""The trainer's exceptions (`darl.trainer`), under `TrainerError`:

TrainerError
├── AggregationError              calls that cannot become training rows   ValueError
│   ├── MissingLogprobsError
│   └── EmptyBatchError
├── DatasetError                  a dataset that cannot be read              ValueError
├── TrainerBackendError           a trainer backend's own failure
│   ├── StepOutOfOrderError
│   ├── CheckpointError
│   ├── BatchError                                                           ValueError
│   └── VerlConfigError                                                      ValueError
├── WeightSyncError               a server refused a step of the sync (4xx)  RuntimeError
└── ReplicasChangingError         gateway replicas kept appearing (retried)  RuntimeError
"""

from __future__ import annotations

from darl.workflows.errors import DarlError


class TrainerError(DarlError):
    """Raised by `darl.trainer`: aggregation, a backend, a dataset or a weight sync failed."""
