"""Rollouts' reports to their trainers, batched: the `report_rollout` local activity hands its
result to the worker's `TrainerReports`, which sends every report waiting for the same trainer
workflow in one `rollouts_finished` signal, and answers each once the server has taken it.

One signal in flight per trainer: what queues behind it goes out in the next, so a burst of
finishing rollouts costs the trainer's workflow a few signals (and a few workflow tasks), not
one each, and no fixed delay is added when rollouts finish one at a time.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from temporalio import activity
from temporalio.client import Client
from temporalio.service import RPCError, RPCStatusCode

from darl.workflows.contracts import RolloutOutcome, RolloutReport
from darl.workflows.names import REPORT_ROLLOUT, ROLLOUTS_FINISHED_SIGNAL

log = logging.getLogger(__name__)

# A batch stays far below Temporal's 2 MB payload limit and its 256 KB warning (an outcome is a
# few hundred bytes; its error is cut at OUTCOME_ERROR_CHARS).
MAX_BATCH_RESULTS = 64
MAX_BATCH_BYTES = 200_000


@dataclass
class _Pending:
    result: RolloutOutcome
    size: int
    # True once the trainer took it; False when the trainer's workflow is not running.
    delivered: asyncio.Future[bool] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


class TrainerReports:
    """Sends finished rollouts' results to their trainers' workflows, batched per trainer."""

    def __init__(
        self,
        client: Client,
        max_results: int = MAX_BATCH_RESULTS,
        max_bytes: int = MAX_BATCH_BYTES,
    ) -> None:
        self._client = client
        self._max_results = max_results
        self._max_bytes = max_bytes
        self._waiting: dict[str, list[_Pending]] = {}
        self._senders: dict[str, asyncio.Task[None]] = {}
        self.signals_sent = 0

    async def report(self, report_to: str, result: RolloutOutcome) -> bool:
        """Deliver `result` to the workflow `report_to`. Returns False when that workflow is
        not running (a trainer that is gone does not undo the rollout); raises the signal's
        RPCError when the server could not be told (the caller retries)."""
        pending = _Pending(result, len(result.model_dump_json()))
        self._waiting.setdefault(report_to, []).append(pending)
        if report_to not in self._senders:
            self._senders[report_to] = asyncio.create_task(self._send_all(report_to))
        # The batch goes out whatever happens to this caller: a cancelled local activity
        # does not tear a signal carrying other rollouts' reports.
        return await asyncio.shield(pending.delivered)

    async def _send_all(self, report_to: str) -> None:
        try:
            while self._waiting.get(report_to):
                await self._send(report_to, self._take_batch(report_to))
        finally:
            del self._senders[report_to]
            if not self._waiting.get(report_to):
                self._waiting.pop(report_to, None)

    def _take_batch(self, report_to: str) -> list[_Pending]:
        waiting = self._waiting[report_to]
        count, size = 0, 0
        for pending in waiting:
            if count and (count == self._max_results or size + pending.size > self._max_bytes):
                break
            count, size = count + 1, size + pending.size
        self._waiting[report_to] = waiting[count:]
        return waiting[:count]

    async def _send(self, report_to: str, batch: list[_Pending]) -> None:
        handle = self._client.get_workflow_handle(report_to)
        try:
            await handle.signal(ROLLOUTS_FINISHED_SIGNAL, [p.result for p in batch])
        except RPCError as err:
            if err.status == RPCStatusCode.NOT_FOUND:
                _settle(batch, False)
            else:
                _fail(batch, err)
            return
        except asyncio.CancelledError:
            for pending in batch:
                pending.delivered.cancel()
            raise
        except Exception as err:  # noqa: BLE001 - not hidden: every caller raises it
            _fail(batch, err)
            return
        self.signals_sent += 1
        _settle(batch, True)


def _settle(batch: list[_Pending], delivered: bool) -> None:
    for pending in batch:
        if not pending.delivered.done():
            pending.delivered.set_result(delivered)


def _fail(batch: list[_Pending], err: Exception) -> None:
    for pending in batch:
        if not pending.delivered.done():
            pending.delivered.set_exception(err)


class ReportActivities:
    """The rollout worker's `report_rollout`, run as a local activity by RolloutWorkflow."""

    def __init__(self, reports: TrainerReports) -> None:
        self._reports = reports

    @activity.defn(name=REPORT_ROLLOUT)
    async def report_rollout(self, report: RolloutReport) -> None:
        if not await self._reports.report(report.report_to, report.result):
            log.warning(
                "%s finished, but its trainer %s is not running: not reported",
                report.result.rollout_id,
                report.report_to,
            )
