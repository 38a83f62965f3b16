"""The viewer's web app: runs, a run's live curves, its rollouts table, a rollout's calls and
training rows, a GRPO group side by side. Read-only; plain HTML from Jinja templates
(autoescaped) and one small script that refreshes a run's curves."""

from __future__ import annotations

import asyncio
import json
import logging
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import urlencode

from fastapi import Depends, FastAPI, Query, Request
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles
from jinja2 import Environment, FileSystemLoader, select_autoescape
from temporalio.service import RPCError

from darl.gateway.store.record import CallRecord
from darl.gateway.store.url import open_store
from darl.trainer.aggregation import TrainingRow
from darl.trainer.run_files import read_metrics
from darl.viewer.charts import charts
from darl.viewer.detokenize import ServerDetokenizer
from darl.viewer.links import web_ui_link
from darl.viewer.render import (
    CallView,
    call_views,
    completion_tokens_html,
    ids_text,
    row_tokens_html,
)
from darl.viewer.temporal_view import (
    PAGE_SIZES,
    NotFoundError,
    RolloutFilters,
    RolloutState,
    RunView,
    TemporalNotReachedError,
    TemporalView,
    WorkflowRow,
)
from darl.viewer.training_rows import (
    dropped_branch,
    group_advantages,
    masked_calls,
    trainer_rows,
)
from darl.viewer.trajectory import TokenText, Trajectory, agent_log_tail, load_trajectory
from darl.workflows.contracts import PrefixSpec, rollout_workflow_id
from darl.workflows.training_config import TrainingConfig, training_workflow_id
from darl.workflows.training_state import StepRecord

log = logging.getLogger(__name__)

HERE = Path(__file__).parent
TEMPLATES = Environment(
    loader=FileSystemLoader(HERE / "templates"),
    autoescape=select_autoescape(default=True, default_for_string=True),
    trim_blocks=True,
    lstrip_blocks=True,
)


@dataclass(frozen=True)
class ViewerSettings:
    store_dir: Path
    runs_dir: Path
    agents_dir: Path
    ui_url: str = "http://127.0.0.1:8233"
    # An s3:// (or file://) URL of the store, in place of `store_dir` (gateway/store_url.py).
    store_url: str | None = None


class Viewer:
    """What every page reads from: Temporal (read-only), the trajectory store, run files."""

    def __init__(self, temporal: TemporalView, settings: ViewerSettings) -> None:
        self.temporal = temporal
        self.settings = settings
        self.store = open_store(settings.store_url or settings.store_dir)
        self.detokenizer = ServerDetokenizer()

    async def served_token_texts(self, calls: list[CallRecord]) -> dict[int, str]:
        """The texts of the calls' token ids as the policy servers that answered them decode
        them (empty for one that cannot be reached)."""
        ids = {i for r in calls for i in (*r.prompt_token_ids, *r.completion_token_ids())}
        texts: dict[int, str] = {}
        for upstream in sorted({r.upstream for r in calls}):
            texts.update(await self.detokenizer.texts(upstream, ids))
        return texts

    def ui_link(self, workflow_id: str) -> str:
        return web_ui_link(self.settings.ui_url, workflow_id, self.temporal.namespace)

    def run_records(self, view: RunView) -> tuple[list[StepRecord], str]:
        """The run's steps: the live `metrics` query, else its metrics.jsonl."""
        if view.records or view.query_error is None:
            return view.records, "the run's metrics query"
        run_dir = Path(
            view.config.run_dir
            if view.config and view.config.run_dir
            else self.settings.runs_dir / view.run_id
        )
        records = [StepRecord.model_validate(r) for r in read_metrics(run_dir)]
        return records, f"{run_dir / 'metrics.jsonl'} (no worker answered the query)"


def get_viewer(request: Request) -> Viewer:
    viewer: Viewer = request.app.state.viewer
    return viewer


ViewerDep = Annotated[Viewer, Depends(get_viewer)]


def page(name: str, status_code: int = 200, **context: Any) -> HTMLResponse:
    return HTMLResponse(TEMPLATES.get_template(name).render(**context), status_code=status_code)


def create_viewer_app(viewer: Viewer) -> FastAPI:
    app = FastAPI(title="DARL viewer", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.viewer = viewer
    app.mount("/static", StaticFiles(directory=HERE / "static"), name="static")

    @app.exception_handler(NotFoundError)
    async def not_found(request: Request, err: NotFoundError) -> HTMLResponse:
        return page("error.html", 404, title="Not found", message=f"Not found: {err.what}")

    @app.exception_handler(TemporalNotReachedError)
    async def temporal_not_reached(request: Request, err: TemporalNotReachedError) -> HTMLResponse:
        return page("error.html", 503, title="Temporal unavailable", message=str(err))

    @app.exception_handler(RPCError)
    async def temporal_error(request: Request, err: RPCError) -> HTMLResponse:
        log.warning("Temporal refused %s: %s", request.url.path, err.message)
        message = f"Temporal answered {err.status.name if err.status else '?'}: {err.message}"
        return page("error.html", 503, title="Temporal unavailable", message=message)

    @app.get("/", response_class=HTMLResponse)
    async def runs(viewer: ViewerDep) -> HTMLResponse:
        rows = await viewer.temporal.runs()
        return page("runs.html", title="Training runs", runs=rows, link=viewer.ui_link)

    @app.get("/runs/{run_id}", response_class=HTMLResponse)
    async def run(run_id: str, viewer: ViewerDep) -> HTMLResponse:
        return page("run.html", **await _run_context(viewer, run_id))

    @app.get("/runs/{run_id}/live", response_class=HTMLResponse)
    async def run_live(run_id: str, viewer: ViewerDep) -> HTMLResponse:
        return page("run_live.html", **await _run_context(viewer, run_id))

    @app.get("/runs/{run_id}/rollouts", response_class=HTMLResponse)
    async def rollouts(
        run_id: str,
        viewer: ViewerDep,
        version: Annotated[str, Query()] = "",
        status: str = "",
        mode: str = "",
        group: str = "",
        reward_min: str = "",
        reward_max: str = "",
        page_token: Annotated[str, Query(alias="page")] = "",
        size: int = 50,
    ) -> HTMLResponse:
        form = {
            "version": version,
            "status": status,
            "mode": mode,
            "group": group,
            "reward_min": reward_min,
            "reward_max": reward_max,
        }
        try:
            filters = RolloutFilters(
                policy_version=_version(version),
                status=status.strip() or None,
                mode=mode.strip() or None,
                group=group.strip() or None,
                reward_min=_finite(reward_min),
                reward_max=_finite(reward_max),
            )
        except ValueError:
            return page(
                "error.html",
                400,
                title="Bad filter",
                message=f"A version is a whole number from 0, a reward a finite number: got {form}",
            )
        size = size if size in PAGE_SIZES else PAGE_SIZES[1]
        found = await viewer.temporal.rollouts(run_id, filters, page_token or None, size)
        answers = await viewer.temporal.answers(found.rows)
        next_url = None
        if found.next_token:
            next_url = "?" + urlencode({**form, "size": size, "page": found.next_token})
        return page(
            "rollouts.html",
            title=f"Rollouts of {run_id}",
            run_id=run_id,
            form=form,
            rows=found.rows,
            answers=answers,
            query=found.query,
            next_url=next_url,
            first_url="?" + urlencode({**form, "size": size}),
            paged=bool(page_token),
            size=size,
            sizes=PAGE_SIZES,
        )

    @app.get("/rollouts/{rollout_id}", response_class=HTMLResponse)
    async def rollout(
        rollout_id: str, viewer: ViewerDep, attempt: int | None = None
    ) -> HTMLResponse:
        context = await _rollout_context(viewer, rollout_id, attempt)
        # Thousands of calls make megabytes of HTML: rendered off the event loop, so the
        # other pages and the run pages' live polls are answered meanwhile.
        return await asyncio.to_thread(page, "rollout.html", **context)

    # A group id may hold "/" (it has no pattern): the rest of the path is the id.
    @app.get("/groups/{group_id:path}", response_class=HTMLResponse)
    async def group(group_id: str, viewer: ViewerDep) -> HTMLResponse:
        return page("group.html", **await _group_context(viewer, group_id))

    return app


async def _run_context(viewer: Viewer, run_id: str) -> dict[str, Any]:
    view = await viewer.temporal.run(run_id)
    records, source = viewer.run_records(view)
    counters = (
        view.progress.counters
        if view.progress
        else (view.summary.counters if view.summary else None)
    )
    return {
        "title": f"Run {run_id}",
        "run": view,
        "records": records,
        "source": source,
        "charts": charts(records),
        "counters": counters.model_dump() if counters else {},
        "ui_link": viewer.ui_link(training_workflow_id(run_id)),
    }


async def _config_of(viewer: Viewer, state: RolloutState | None) -> TrainingConfig | None:
    if state is None or state.spec is None:
        return None
    return await viewer.temporal.training_config(state.spec.run_id)


async def _rollout_context(viewer: Viewer, rollout_id: str, attempt: int | None) -> dict[str, Any]:
    state = await viewer.temporal.rollout(rollout_id)
    wanted = attempt if attempt is not None else (state.last_attempt if state else None)
    trajectory = await load_trajectory(viewer.store, rollout_id, wanted)
    if state is None and not trajectory.in_store:
        raise NotFoundError(
            f"rollout {rollout_id!r} (Temporal has no {rollout_workflow_id(rollout_id)} and "
            f"the trajectory store has no {viewer.store.where(rollout_id)})"
        )
    config = await _config_of(viewer, state)
    served = await viewer.served_token_texts(trajectory.calls)
    return await asyncio.to_thread(
        _rollout_page, viewer, rollout_id, state, trajectory, config, served
    )


def _rollout_page(
    viewer: Viewer,
    rollout_id: str,
    state: RolloutState | None,
    trajectory: Trajectory,
    config: TrainingConfig | None,
    served: dict[int, str],
) -> dict[str, Any]:
    """The rollout page's token text, training rows and token HTML: CPU work in proportion
    to the calls, run in a thread (and the agent log read from disk)."""
    result = state.result if state else None
    committed = set(result.call_ids) if result and result.call_ids else None
    trained_calls = [c for c in trajectory.calls if committed is None or c.call_id in committed]
    tokens = TokenText(trajectory.calls, served, config)
    # A branch masks the prefix it reproduced; a seed's mask (its group's branch point) is
    # not known from its own spec, so its page shows the rows of every call.
    aggregated = trainer_rows(
        rollout_id,
        state.spec.group_id if state and state.spec else "",
        result.reward if result else None,
        trained_calls,
        config,
        masked_calls(state.spec if state else None, result, None, config),
    )
    return {
        "title": f"Rollout {rollout_id}",
        "rollout_id": rollout_id,
        "task_json": json.dumps(state.spec.task, indent=1) if state and state.spec else "",
        "state": state,
        "result": result,
        "trajectory": trajectory,
        "calls": call_views(trajectory.calls),
        "committed": committed,
        "token_html": {r.call_id: completion_tokens_html(r, tokens) for r in trajectory.calls},
        "aggregated": aggregated,
        "row_html": [row_tokens_html(row, tokens) for row in aggregated.rows],
        "prompt_text": [ids_text(row.prompt_ids, tokens) for row in aggregated.rows],
        "config": config,
        "token_source": tokens.source,
        "log_tail": agent_log_tail(viewer.settings.agents_dir, rollout_id, trajectory.attempt),
        "ui_link": viewer.ui_link(rollout_workflow_id(rollout_id)),
        "run_link": viewer.ui_link(training_workflow_id(state.spec.run_id))
        if state and state.spec
        else None,
    }


@dataclass(frozen=True)
class Member:
    rollout_id: str
    state: RolloutState | None
    completion: str
    calls: int
    advantage: float | None
    masked: int = 0
    """Its first calls the trainer keeps out of its rows (`masked_calls`)."""
    rows: int = 0
    continuation: int | None = None
    """In a branching group: its calls after the shared prefix (None: not known yet)."""
    dropped: bool = False
    """A branch that left its prefix early, left out of its group (`dropped_branch`)."""


@dataclass(frozen=True)
class SharedPrefix:
    """A branching group's prefix: the seed's first `calls` calls, replayed to each branch."""

    seed: str
    attempt: int
    calls: int
    views: list[CallView]


def _group_prefix(states: list[RolloutState | None]) -> PrefixSpec | None:
    """The prefix the group's branches start from (one seed's, the same k for all)."""
    return next((s.spec.prefix for s in states if s and s.spec and s.spec.prefix), None)


def _prefix_start(rollout_id: str, state: RolloutState | None, prefix: PrefixSpec) -> int | None:
    """Where a member's own calls after the shared prefix begin: the seed's at k, a branch's
    after the prefix calls it reproduced (None until its result says)."""
    if rollout_id == prefix.rollout_id:
        return prefix.calls
    return state.result.prefix_calls if state and state.result else None


def _members(
    group_id: str,
    rows: list[WorkflowRow],
    states: list[RolloutState | None],
    trajectories: list[Trajectory],
    config: TrainingConfig | None,
    prefix: PrefixSpec | None,
) -> tuple[list[Member], list[float]]:
    """Each member's last completion, masked calls, rows and advantage (over the rows the
    trainer makes, the prefix masked as it masks it), and the group's rewards."""
    training_rows, members = [], []
    for row, state, trajectory in zip(rows, states, trajectories, strict=True):
        calls = len(trajectory.calls)
        text = call_views(trajectory.calls)[-1].completion if trajectory.calls else ""
        result = state.result if state else None
        seed_k = prefix.calls if prefix and row.name == prefix.rollout_id else None
        masked = masked_calls(state.spec if state else None, result, seed_k, config)
        start = _prefix_start(row.name, state, prefix) if prefix else None
        continuation = max(calls - start, 0) if start is not None else None
        made: list[TrainingRow] = []
        dropped = dropped_branch(result, config)
        # Trained: a reward, and not a branch its group leaves out.
        if result is not None and result.reward is not None and not dropped:
            committed = set(result.call_ids)
            records = [c for c in trajectory.calls if not committed or c.call_id in committed]
            made = trainer_rows(row.name, group_id, result.reward, records, config, masked).rows
        training_rows += made
        members.append(
            Member(row.name, state, text, calls, None, masked, len(made), continuation, dropped)
        )
    advantages = group_advantages(training_rows, config)
    rewards = [s.result.reward for s in states if s and s.result and s.result.reward is not None]
    return [replace(m, advantage=advantages.get(m.rollout_id)) for m in members], rewards


async def _group_context(viewer: Viewer, group_id: str) -> dict[str, Any]:
    rows = await viewer.temporal.group(group_id)
    if not rows:
        raise NotFoundError(f"group {group_id!r} (no rollout has DarlGroup = {group_id!r})")
    states = await asyncio.gather(*(viewer.temporal.rollout(row.name) for row in rows))
    config = await _config_of(viewer, next((s for s in states if s and s.spec), None))
    trajectories = [
        await load_trajectory(viewer.store, row.name, state.last_attempt if state else None)
        for row, state in zip(rows, states, strict=True)
    ]
    prefix = _group_prefix(states)
    shared = None
    if prefix is not None:
        seed = await load_trajectory(viewer.store, prefix.rollout_id, prefix.attempt)
        views = call_views(seed.calls)[: prefix.calls]
        shared = SharedPrefix(prefix.rollout_id, prefix.attempt, prefix.calls, views)
    # The rows and verl's estimator (torch) are CPU work: off the event loop.
    members, rewards = await asyncio.to_thread(
        _members, group_id, rows, states, trajectories, config, prefix
    )
    return {
        "title": f"Group {group_id}",
        "group_id": group_id,
        "run_id": next((row.run for row in rows if row.run), None),
        "prefix": shared,
        "members": members,
        "config": config,
        "reward_mean": sum(rewards) / len(rewards) if rewards else None,
        "link": viewer.ui_link,
    }


def _version(text: str) -> int | None:
    """A policy version filter: a whole number that fits DarlPolicyVersion (an Int, 64 bits)."""
    if not text.strip():
        return None
    value = int(text)
    if not 0 <= value < 2**63:
        raise ValueError(f"policy version {value} out of range")
    return value


def _finite(text: str) -> float | None:
    """A reward bound: a finite number (nan and inf make Temporal refuse the query)."""
    if not text.strip():
        return None
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"reward bound {text!r} is not finite")
    return value
