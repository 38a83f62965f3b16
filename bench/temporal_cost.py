"""What Temporal does for one rollout, read off workflow histories: events by type and the
actions a Temporal Cloud namespace bills (and rate-limits) for them.

Actions counted: a workflow start (a continue-as-new is one too), each activity scheduled,
each workflow task's local activities (Cloud bills one action per task that ran any), each
signal sent (the gateway's to a rollout, a rollout's report to its trainer: a signal-external
is counted in the rollout's history, the rollout worker's batches of reports where the trainer
received them), each search-attribute upsert, each timer, and each heartbeat the server
records. Heartbeats leave no event: they are estimated
from each heartbeating activity's run time and the SDK's throttle (the first heartbeat is sent
at once, later ones at most once per 80% of the heartbeat timeout).
"""

from __future__ import annotations

import json
import statistics
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from temporalio.api.enums.v1 import EventType
from temporalio.api.history.v1 import HistoryEvent

from darl.workflows.names import ROLLOUT_FINISHED_SIGNAL

# The SDK's longest heartbeat throttle (Worker's max_heartbeat_throttle_interval).
MAX_THROTTLE_SECONDS = 60.0


@dataclass(frozen=True)
class HeartbeatSchedule:
    """When an activity calls `activity.heartbeat`: first after `first_after` seconds, then
    every `every` seconds."""

    first_after: float
    every: float


def heartbeats_sent(seconds: float, schedule: HeartbeatSchedule, timeout: float) -> int:
    """How many heartbeats the SDK sends to the server for an activity that ran `seconds`."""
    throttle = min(0.8 * timeout, MAX_THROTTLE_SECONDS)
    sent, window_end, pending = 0, None, False
    at = schedule.first_after
    while at < seconds:
        if window_end is not None and at >= window_end:
            # The throttle window closed: its pending heartbeat went out then.
            if pending:
                sent += 1
                window_end += throttle
                pending = False
                continue
            window_end = None
        if window_end is None:
            sent += 1
            window_end = at + throttle
        else:
            pending = True
        at += schedule.every
    if pending and window_end is not None and window_end < seconds:
        sent += 1
    return sent


@dataclass
class Cost:
    """Events and actions of a set of histories."""

    histories: int = 0
    events: Counter[str] = field(default_factory=Counter)
    actions: Counter[str] = field(default_factory=Counter)
    lengths: list[int] = field(default_factory=list)
    # How long each workflow task that ran local activities was held (started -> completed):
    # a rollout's report waits for its batch's signal there.
    local_task_seconds: list[float] = field(default_factory=list)

    def per_history(self, count: float) -> float:
        return count / max(self.histories, 1)


def _name(event: HistoryEvent) -> str:
    return EventType.Name(event.event_type).removeprefix("EVENT_TYPE_").lower()


def _local_activity_type(event: HistoryEvent) -> str | None:
    attrs = event.marker_recorded_event_attributes
    if attrs.marker_name != "core_local_activity":
        return None
    data = attrs.details.get("data")
    if data is None or not data.payloads:
        return "?"
    return json.loads(data.payloads[0].data).get("activity_type", "?")


def add_history(
    cost: Cost,
    events: Iterable[HistoryEvent],
    heartbeats: HeartbeatSchedule | None = None,
    own_signals_only: bool = False,
) -> None:
    """Count one history into `cost`. `own_signals_only` leaves out the rollouts' single
    reports a trainer receives (counted as sent by each rollout's signal-external); the
    worker's batches of reports are counted there."""
    events = list(events)
    cost.histories += 1
    cost.lengths.append(len(events))
    started: dict[int, HistoryEvent] = {}
    scheduled: dict[int, HistoryEvent] = {}
    # A task's commands (a local activity's marker among them) follow its completed event.
    local_in_task = False
    task_started: HistoryEvent | None = None
    task_held = 0.0
    for event in events:
        name = _name(event)
        cost.events[name] += 1
        kind = event.event_type
        if kind == EventType.EVENT_TYPE_WORKFLOW_TASK_STARTED:
            task_started = event
        if kind == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_STARTED:
            # Each run of a continue-as-new chain starts with its own.
            cost.actions["workflow start"] += 1
        elif kind == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
            cost.actions["activity"] += 1
            scheduled[event.event_id] = event
        elif kind == EventType.EVENT_TYPE_ACTIVITY_TASK_STARTED:
            started[event.activity_task_started_event_attributes.scheduled_event_id] = event
        elif kind == EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED and heartbeats is not None:
            which = event.activity_task_completed_event_attributes.scheduled_event_id
            if which in started and which in scheduled:
                attrs = scheduled[which].activity_task_scheduled_event_attributes
                timeout = attrs.heartbeat_timeout.ToTimedelta().total_seconds()
                ran = event.event_time.ToDatetime() - started[which].event_time.ToDatetime()
                if timeout > 0:
                    cost.actions["heartbeat (estimated)"] += heartbeats_sent(
                        ran.total_seconds(), heartbeats, timeout
                    )
        elif kind == EventType.EVENT_TYPE_MARKER_RECORDED:
            activity_type = _local_activity_type(event)
            if activity_type is not None:
                if not local_in_task:
                    cost.actions["local activities (per task)"] += 1
                    cost.local_task_seconds.append(task_held)
                local_in_task = True
        elif kind == EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED:
            if task_started is not None:
                held = event.event_time.ToDatetime() - task_started.event_time.ToDatetime()
                task_held = held.total_seconds()
            local_in_task = False
        elif kind == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED:
            signal = event.workflow_execution_signaled_event_attributes.signal_name
            if not (own_signals_only and signal == ROLLOUT_FINISHED_SIGNAL):
                cost.actions[f"signal received ({signal})"] += 1
        elif kind == EventType.EVENT_TYPE_SIGNAL_EXTERNAL_WORKFLOW_EXECUTION_INITIATED:
            cost.actions["signal sent (report)"] += 1
        elif kind == EventType.EVENT_TYPE_UPSERT_WORKFLOW_SEARCH_ATTRIBUTES:
            cost.actions["search-attribute upsert"] += 1
        elif kind == EventType.EVENT_TYPE_TIMER_STARTED:
            cost.actions["timer"] += 1


def report(rollouts: Cost, trainer: Cost, rollouts_started: int) -> float:
    """Print the per-rollout table; returns the actions per rollout (the trainer's share
    included)."""
    if not rollouts.histories:
        print("no rollout histories sampled")
        return 0.0
    lengths = rollouts.lengths
    print(
        f"Rollout history: {statistics.fmean(lengths):.1f} events per trained rollout (min "
        f"{min(lengths)}, max {max(lengths)}, {rollouts.histories} sampled), by type:"
    )
    for name, count in rollouts.events.most_common():
        print(f"  {name:<48}{rollouts.per_history(count):>6.2f}")
    held = sorted(rollouts.local_task_seconds)
    if held:
        print(
            f"  a workflow task running the report (local activity) was held "
            f"{1000 * statistics.median(held):.0f} ms median, {1000 * held[-1]:.0f} ms at most"
        )
    print("Temporal actions per trained rollout:")
    own = 0.0
    for name, count in sorted(rollouts.actions.items()):
        own += rollouts.per_history(count)
        print(f"  {name:<48}{rollouts.per_history(count):>6.2f}")
    per = max(rollouts_started, 1)
    share = sum(trainer.actions.values()) / per
    print(f"  {'the trainer workflow (its actions / rollouts)':<48}{share:>6.2f}")
    for name, count in sorted(trainer.actions.items()):
        print(f"    {name:<46}{count / per:>6.2f}")
    total = own + share
    print(
        f"  {'all':<48}{total:>6.2f}  -> a namespace limited to 500 actions/s sustains "
        f"{500 / total:.1f} rollouts/s"
    )
    return total


@dataclass(frozen=True)
class ServerCounts:
    """Counters the Temporal server itself keeps (its Prometheus metrics): the persistence
    requests of the `default` namespace (what its CPU mostly goes to) and the RPCs by name."""

    persistence: float
    requests: dict[str, float]

    def minus(self, earlier: ServerCounts) -> ServerCounts:
        return ServerCounts(
            self.persistence - earlier.persistence,
            {k: v - earlier.requests.get(k, 0.0) for k, v in self.requests.items()},
        )


def server_metrics_url(log_text: str) -> str | None:
    """The dev server prints where its metrics are (`Temporal Metrics: http://...`)."""
    for line in log_text.splitlines():
        if line.strip().startswith("Temporal Metrics:"):
            return line.split(":", 1)[1].strip()
    return None


def parse_server_counts(text: str) -> ServerCounts:
    persistence = 0.0
    requests: Counter[str] = Counter()
    for line in text.splitlines():
        if line.startswith("persistence_requests{") and 'namespace="default"' in line:
            persistence += float(line.rsplit(" ", 1)[1])
        elif line.startswith("service_requests{") and 'service_name="frontend"' in line:
            labels = line[line.index("{") + 1 : line.rindex("}")]
            operation = next(
                (
                    p.split("=", 1)[1].strip('"')
                    for p in labels.split(",")
                    if p.startswith("operation=")
                ),
                "?",
            )
            requests[operation] += float(line.rsplit(" ", 1)[1])
    return ServerCounts(persistence, dict(requests))


def report_server(counts: ServerCounts, rollouts: int) -> None:
    per = max(rollouts, 1)
    print(
        f"Temporal server, per rollout started: {counts.persistence / per:.1f} persistence "
        f"requests; heartbeats recorded (RecordActivityTaskHeartbeat): "
        f"{counts.requests.get('RecordActivityTaskHeartbeat', 0.0) / per:.2f}; frontend RPCs:"
    )
    busiest = sorted(counts.requests.items(), key=lambda item: -item[1])[:8]
    for name, count in busiest:
        print(f"  {name:<48}{count / per:>6.2f}")
