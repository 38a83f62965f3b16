"""The Kubernetes runner's settings (the worker's `--k8s-*` flags), checked when the worker
starts, and the Kubernetes size quantities they are written in (`20Gi`, `500M`)."""

from __future__ import annotations

import re
from dataclasses import dataclass

# Kubernetes' quantity suffixes (of a volume's size), as multiples of a byte.
QUANTITY_SUFFIXES = {
    **{s: 1024 ** (i + 1) for i, s in enumerate(("Ki", "Mi", "Gi", "Ti", "Pi", "Ei"))},
    **{s: 1000 ** (i + 1) for i, s in enumerate(("k", "M", "G", "T", "P", "E"))},
    "": 1,
}
QUANTITY = re.compile(r"(\d+(?:\.\d+)?)([A-Za-z]*)")


def quantity_bytes(quantity: str) -> int:
    """The bytes a Kubernetes quantity names (`20Gi`, `500M`, `1073741824`); ValueError for
    anything else."""
    match = QUANTITY.fullmatch(quantity.strip())
    if match is None or match.group(2) not in QUANTITY_SUFFIXES:
        raise ValueError(f"{quantity!r} is not a size Kubernetes takes (e.g. 20Gi, 500M)")
    return int(float(match.group(1)) * QUANTITY_SUFFIXES[match.group(2)])


@dataclass(frozen=True)
class KubernetesSettings:
    namespace: str = "darl-agents"
    # None: kr8s finds the cluster (kubeconfig, or the in-cluster service account).
    api_url: str | None = None
    jobs_per_minute: float = 120.0
    ttl_seconds_after_finished: int = 3600
    # A Pod the scheduler cannot place for this long is an infra failure.
    unschedulable_seconds: float = 120.0
    run_as_user: int = 10001
    # Where a Job that asks for root runs, and the RuntimeClass (gVisor's) it runs under:
    # the operator's choice, both or neither. Without them such a Job is refused.
    sandbox_namespace: str | None = None
    sandbox_runtime_class: str | None = None
    # Grading an agent (a reward `grader`): DARL's own image, whose container does the
    # grading's trusted steps in the grading Job; the size and class of each attempt's
    # volume; where DARL mounts its folders in the Jobs' containers.
    grading_image: str | None = None
    grading_volume_size: str = "20Gi"
    grading_storage_class: str | None = None
    grading_mount_root: str = "/darl"
    # The Python of DARL's image.
    grading_python: str = "python"

    def __post_init__(self) -> None:
        if (self.sandbox_namespace is None) != (self.sandbox_runtime_class is None):
            raise ValueError(
                "give the sandbox namespace and the sandbox RuntimeClass together: root Jobs "
                "run only under a sandboxing runtime (gVisor's runsc)"
            )
        # Refused here, with the worker's flag, rather than by the API at each attempt.
        quantity_bytes(self.grading_volume_size)
        if self.sandbox_namespace is not None and self.sandbox_namespace == self.namespace:
            raise ValueError(
                f"the sandbox namespace must not be the agents' namespace {self.namespace!r}: "
                "that one enforces the restricted Pod Security Standard, which refuses root"
            )
