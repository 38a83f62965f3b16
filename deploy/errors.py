"""Running DARL's exceptions (`darl.deploy`), under `DeployError`:

DeployError
├── CliError                  a client command's one-line error and exit status (cli/support.py)
├── ConfigFileError           a config file that cannot be read or is not a      ValueError
│                             TrainingConfig (config_file.py)
├── ProcessFailedError        a component exited or never became ready           RuntimeError
│                             (processes.py)
├── TelemetryConfigError      an OTEL_TRACES_EXPORTER DARL cannot export to      ValueError
│                             (telemetry.py)
└── TemporalUnreachableError  no Temporal server answered (temporal_connection.py)
"""

from __future__ import annotations

from darl.workflows.errors import DarlError


class DeployError(DarlError):
    """Raised by `darl.deploy`: the CLI, a config file, a child process, telemetry set-up or
    the connection to Temporal."""


def single_line(text: str) -> str:
    """`text` with each run of whitespace, newlines included, one space: a message as the
    one-line error a command prints."""
    return " ".join(text.split())
