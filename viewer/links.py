"""Links a user follows: a run's page in the viewer, a workflow in the Temporal Web UI."""

from __future__ import annotations

from urllib.parse import quote


def viewer_run_link(viewer_url: str, run_id: str) -> str:
    return f"{viewer_url}/runs/{quote(run_id, safe='')}"


def web_ui_link(ui_url: str, workflow_id: str, namespace: str = "default") -> str:
    return f"{ui_url}/namespaces/{namespace}/workflows/{quote(workflow_id, safe='')}"
