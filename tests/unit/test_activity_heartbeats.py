"""The one decorator that makes an activity heartbeat while it runs (`heartbeats_throughout`):
Temporal still reads the activity's signature through it, and it heartbeats, without details,
at the cadence of the activity's heartbeat timeout; and a `Heartbeater` as the sandbox's test
run awaits through it, killed at its deadline and only then."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from datetime import timedelta

from temporalio import activity
from temporalio.testing import ActivityEnvironment

from darl.activities.heartbeats import Heartbeater, heartbeats_throughout
from darl.activities.sandbox.bubblewrap import _wait_or_kill


@activity.defn(name="slow")
@heartbeats_throughout(5.0)
async def slow(seconds: float) -> str:
    """Sleeps, heartbeating nothing itself."""
    await asyncio.sleep(seconds)
    return "done"


def test_the_activity_keeps_its_name_signature_and_doc() -> None:
    definition = activity._Definition.must_from_callable(slow)
    assert definition.name == "slow"
    assert definition.arg_types == [float] and definition.ret_type is str
    assert slow.__doc__ == "Sleeps, heartbeating nothing itself."


async def test_it_heartbeats_while_the_activity_runs() -> None:
    env = ActivityEnvironment()
    # Three heartbeats per heartbeat timeout: every 0.2 s here.
    env.info = dataclasses.replace(env.info, heartbeat_timeout=timedelta(seconds=0.6))
    beats: list[tuple[object, ...]] = []
    env.on_heartbeat = lambda *details: beats.append(details)
    assert await env.run(slow, 0.7) == "done"
    assert 1 <= len(beats) <= 4
    assert all(details == () for details in beats)


async def test_a_quick_activity_sends_no_heartbeat() -> None:
    env = ActivityEnvironment()
    beats: list[tuple[object, ...]] = []
    env.on_heartbeat = lambda *details: beats.append(details)
    assert await env.run(slow, 0.0) == "done"
    assert beats == []


async def test_a_heartbeater_beats_while_each_step_runs_and_gives_its_result() -> None:
    """The steps of a grading each heartbeat through the one `Heartbeater` handed to them: a
    step that is done at once beats never; one that can only end after three beats gets them
    (no clock in the claim: the step waits for the beats themselves)."""
    beats: list[tuple[object, ...]] = []
    three_beats = asyncio.Event()

    def beat(*details: object) -> None:
        beats.append(details)
        if len(beats) == 3:
            three_beats.set()

    heartbeater = Heartbeater(beat, every=0.01)
    assert await heartbeater(asyncio.sleep(0, "at once")) == "at once"
    assert beats == []

    async def step() -> str:
        await three_beats.wait()
        return "after three beats"

    assert await asyncio.wait_for(heartbeater(step()), 30) == "after three beats"
    assert len(beats) >= 3 and all(details == () for details in beats)


async def test_a_sandboxed_run_is_killed_at_its_deadline_and_only_then() -> None:
    """The grading's test run waits through a Heartbeater: a process past its deadline is
    killed and says so; one that ended by the deadline was not killed, even awaited late."""
    heartbeater = Heartbeater(lambda *_: None, every=0.05)
    sleeper = await asyncio.create_subprocess_exec("sleep", "30", start_new_session=True)
    assert await _wait_or_kill(sleeper, time.monotonic() + 0.3, heartbeater) is True
    assert sleeper.returncode == -9
    ended = await asyncio.create_subprocess_exec("true", start_new_session=True)
    await ended.wait()
    assert await _wait_or_kill(ended, time.monotonic() - 1, heartbeater) is False
    assert ended.returncode == 0
