"""The viewer's exceptions (`darl.viewer`), under `ViewerError`:

ViewerError
├── NotFoundError             nothing knows what a page asked for (404)   LookupError
└── TemporalNotReachedError   Temporal not reached yet (503)
"""

from __future__ import annotations

from darl.workflows.errors import DarlError


class ViewerError(DarlError):
    """Raised by `darl.viewer`: what a page asked for cannot be shown."""
