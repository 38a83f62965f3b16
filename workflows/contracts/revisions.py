"""The revisions of a rollout's command sequence: `RolloutSpec.revision` says which one its
RolloutWorkflow runs, and a history replays only under the revision that recorded it. The
table below is the one place that says what each revision does and what branches on it.

```text
revision  what the workflow does                       what branches on it
--------  -------------------------------------------  ------------------------------------
1         an attempt is launch_agent, then await_agent  nothing: the sequence the others
          beside a timer at the rollout timeout         change
          (await_agent's own deadline is
          RUNNER_DEADLINE_GRACE later); RUNNING is
          upserted on every attempt; a reward function
          runs in a compute_reward activity of its own;
          the outcome reaches `report_to` by a
          `rollout_finished` signal-external

2         an attempt is one activity: no timer (the     RolloutWorkflow._one_activity:
          runner ends the agent at the rollout timeout  _await_agent;
          itself); a function reward or a grade comes   RolloutVisibility.publish_status;
          back in await_agent's result; a first         AwaitRequest.one_activity:
          attempt leaves RUNNING to the status query    RolloutActivities.await_agent,
                                                        _graded, _closed; agent_deadline

3         as 2, and the outcome reaches `report_to` by  RolloutWorkflow._local_report:
          the local activity `report_rollout` in the    _report; activities/
          last workflow task; the worker batches the    trainer_reports.py
          reports for one trainer into one
          `rollouts_finished` signal
```

In every revision the close's call events come back in await_agent's result (up to
RETURNED_EVENTS_CAP; more are signalled).

The starter says the revision: the TrainingWorkflow starts CURRENT_REVISION
(`StartRolloutsRequest.revision`, set in `training_rollout_starts.start_rollouts`); `darl rollout`
starts what the spec file says, CURRENT_REVISION if it says none; the temporal CLI starts what
the file says (the rollout files under examples/ say 3).
`RolloutSpec.revision` defaults to 1, so a spec that names none, and every history recorded
from one, replays as revision 1 (tests/workflow/histories).

The revision is a field rather than `workflow.patched`, whose marker and TemporalChangeVersion
upsert would cost every rollout two history events. The TrainingWorkflow, one per run, does use
`workflow.patched`; its markers are listed in its module docstring (training_workflow.py).
"""

from __future__ import annotations

ONE_ACTIVITY_REVISION = 2
"""The revision from which an attempt is one activity (the table above)."""
LOCAL_REPORT_REVISION = 3
"""The revision from which the outcome reaches `report_to` by the local activity
`report_rollout`."""
CURRENT_REVISION = LOCAL_REPORT_REVISION
"""The revision the TrainingWorkflow and `darl rollout` start: say it in a spec of your
own."""
