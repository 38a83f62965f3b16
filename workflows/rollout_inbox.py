"""What a rollout's workflow takes in from the gateway: its model calls (by signal or in the
close's result, each once by call id) and its agent's reports (`merged` into one), only for
the attempt that is running; what comes twice or late is counted and kept out. Deterministic."""

from __future__ import annotations

from typing import overload

from darl.workflows.contracts import AgentReport, ModelCallEvent


class RolloutInbox:
    """The current attempt's calls and reports, and the rollout's counts of signals it kept
    out. Opened when an attempt starts, closed when its agent has ended."""

    def __init__(self, starts_from_prefix: bool) -> None:
        self._starts_from_prefix = starts_from_prefix
        self._attempt = 0
        self._open = False
        # The current attempt's calls, in the order they came.
        self.calls: list[ModelCallEvent] = []
        self._seen_call_ids: set[str] = set()
        # Calls that reproduce the prefix's (a branch's), directly or through an earlier
        # attempt: what an attempt whose close never came counts as its prefix.
        self._prefix_replays: set[str] = set()
        self._reports: dict[int, AgentReport] = {}
        self.duplicate_signals = 0
        self.stale_signals = 0
        # The latest call received (highest attempt, then sequence): its version is the
        # rollout's last serving version, DarlPolicyVersion.
        self._last_call: ModelCallEvent | None = None

    def open(self, attempt: int) -> None:
        """Take in what comes for `attempt` from now on; the attempt before's calls and
        reports are dropped."""
        self._attempt = attempt
        self.calls = []
        self._reports.pop(attempt - 1, None)
        self._open = True

    def close(self) -> None:
        """The attempt's agent has ended: whatever comes for it now is stale."""
        self._open = False

    def take_calls(self, events: list[ModelCallEvent], by_signal: bool = True) -> None:
        """Take calls in, by signal or from await_agent's result (which holds every call of
        the attempt, some perhaps signalled already: not duplicate signals)."""
        for event in events:
            if event.call_id in self._seen_call_ids:
                if by_signal:
                    self.duplicate_signals += 1
                continue
            self._seen_call_ids.add(event.call_id)
            if event.attempt != self._attempt or not self._open:
                self.stale_signals += 1
                continue
            self.calls.append(event)
            if self._reproduces_the_prefix(event):
                self._prefix_replays.add(event.call_id)
            last = self._last_call
            if last is None or (event.attempt, event.sequence) > (last.attempt, last.sequence):
                self._last_call = event

    def take_report(self, report: AgentReport) -> None:
        """A later report of the attempt overrides the fields it sets (the last reward wins)
        and keeps those it leaves out. One over a report's budget (sent around the gateway,
        which refuses it) is counted with the stale ones, unused."""
        if report.attempt != self._attempt or not self._open or report.over_budget() is not None:
            self.stale_signals += 1
            return
        self._reports[report.attempt] = merged(self._reports.get(report.attempt), report)

    def report(self, attempt: int) -> AgentReport | None:
        """What the agent of `attempt` reported by signal, merged."""
        return self._reports.get(attempt)

    def serving_version(self, at_start: int) -> int:
        """The policy version that served the latest call received; `at_start` before any."""
        last = self._last_call
        return last.policy_version if last is not None else at_start

    def replayed_calls(self) -> int:
        return sum(1 for c in self.calls if c.replayed_from is not None)

    def prefix_replays(self) -> int:
        """The current attempt's calls that reproduced the prefix, as far as the workflow
        saw them replayed: never counted as a resumption."""
        return sum(1 for c in self.calls if c.call_id in self._prefix_replays)

    def _reproduces_the_prefix(self, event: ModelCallEvent) -> bool:
        """Whether a call replays the prefix's (a branch's): one replayed from a call of
        another rollout, or from a call of an earlier attempt of this one that did (a call
        replayed from an earlier attempt's own is a resumption)."""
        source = event.replayed_from
        if not self._starts_from_prefix or source is None:
            return False
        return source not in self._seen_call_ids or source in self._prefix_replays


@overload
def merged(earlier: AgentReport | None, later: AgentReport) -> AgentReport: ...
@overload
def merged(earlier: AgentReport | None, later: AgentReport | None) -> AgentReport | None: ...
def merged(earlier: AgentReport | None, later: AgentReport | None) -> AgentReport | None:
    """A later report overrides the fields it sets and keeps those it leaves out, while the
    two together fit one report's budget (REPORT_MAX_BYTES); past it the later one stands
    alone, so reports with new metadata keys each cannot grow the rollout's result."""
    if earlier is None or later is None:
        return later or earlier
    both = AgentReport(
        attempt=later.attempt or earlier.attempt,
        reward=later.reward if later.reward is not None else earlier.reward,
        answer=later.answer if later.answer is not None else earlier.answer,
        metadata={**earlier.metadata, **later.metadata},
    )
    return later if both.over_budget() else both
