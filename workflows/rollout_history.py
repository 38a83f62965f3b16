"""The room a rollout's history leaves for another attempt (rule 12): Temporal ends a workflow
whose history passes 50 MB, report and all, so a rollout stops retrying well before that and
ends with the failure it has, saying why."""

from __future__ import annotations

from temporalio import workflow

# A rollout starts another attempt only while its history is at most this: an attempt at its
# bounds (the spec in each activity's input, 32 reports, 2,048 call events, its close) adds
# well under 10 MiB.
HISTORY_FOR_ANOTHER_ATTEMPT = 32 * 2**20


def no_room_for_another_attempt(attempt: int) -> str | None:
    """Why the history has no room for an attempt after `attempt`, or None when it has."""
    size = workflow.info().get_current_history_size()
    if size <= HISTORY_FOR_ANOTHER_ATTEMPT:
        return None
    return (
        f"no attempt after {attempt}: the rollout's history holds "
        f"{size / 2**20:.1f} MiB of the 50 MB Temporal allows"
    )
