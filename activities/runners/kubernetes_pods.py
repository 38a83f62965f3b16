"""What a Pod's status fields say of its attempt, never its messages' text: an infra failure
(an image that cannot be pulled, a Pod that cannot be scheduled, an eviction, a lost node), a
Pod taken from its agent, a container's end."""

from __future__ import annotations

import time
from datetime import datetime
from typing import Any

# Container waiting reasons that mean the image will not run here.
IMAGE_FAILURES = frozenset(
    {"ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull"}
)


def first_terminated(pod: Any) -> dict | None:
    """The `terminated` state of the Pod's first container that has ended, if any."""
    if pod is None:
        return None
    for status in pod.raw.get("status", {}).get("containerStatuses", []) or []:
        terminated = status.get("state", {}).get("terminated")
        if terminated:
            return terminated
    return None


def deleted_under_the_agent(pod: Any) -> str | None:
    """Why the Pod of a Job that failed (not at its deadline) was taken from its agent, if it
    was: deleted (gone, or terminating: DARL deletes only the Job, and never before the
    agent ended), or disrupted (preempted, evicted, a tainted node: DisruptionTarget)."""
    if pod is None:
        return "its Pod was deleted"
    if pod.raw.get("metadata", {}).get("deletionTimestamp"):
        return "its Pod was deleted while the agent ran"
    for condition in pod.raw.get("status", {}).get("conditions", []) or []:
        if condition.get("type") == "DisruptionTarget" and condition.get("status") == "True":
            return f"its Pod was disrupted ({condition.get('reason', 'unknown reason')})"
    return None


def pod_infra_problem(pod: Any, unschedulable_seconds: float) -> str | None:
    """What makes an attempt an infra failure, read from status fields."""
    if pod is None:
        return None
    status = pod.raw.get("status", {})
    if status.get("reason") in {"Evicted", "NodeLost", "Preempting"}:
        return f"the Pod was {status['reason'].lower()}"
    if status.get("phase") == "Unknown":
        return "the Pod's node was lost"
    statuses = [
        *(status.get("initContainerStatuses") or []),
        *(status.get("containerStatuses") or []),
    ]
    for container in statuses:
        waiting = container.get("state", {}).get("waiting") or {}
        if waiting.get("reason") in IMAGE_FAILURES:
            return f"image {container.get('image')} cannot be pulled ({waiting['reason']})"
    for condition in status.get("conditions", []) or []:
        if (
            condition.get("type") == "PodScheduled"
            and condition.get("status") == "False"
            and condition.get("reason") == "Unschedulable"
        ):
            created = pod.raw.get("metadata", {}).get("creationTimestamp")
            age = age_seconds(created)
            if age is None or age >= unschedulable_seconds:
                return f"the Pod cannot be scheduled: {condition.get('message', '')}".strip()
    return None


def age_seconds(timestamp: str | None) -> float | None:
    """Seconds since an API timestamp (`2026-01-01T00:00:00Z`); None if there is none."""
    if not timestamp:
        return None
    try:
        created = datetime.fromisoformat(timestamp.replace("Z", "+00:00"))
    except ValueError:
        return None
    return time.time() - created.timestamp()
