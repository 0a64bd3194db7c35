"""The `jobs:` config of the fixture's render family (tests/upstream/job_fixtures.py), and reading what the
fixture counted, for the job flow tests."""

from __future__ import annotations

import json
from typing import Any

from tests.support.clients import Tasks

RENDER_STATES = {"running": "working", "done": "completed", "failed": "failed", "cancelled": "cancelled"}


def render_job(**overrides: Any) -> dict[str, Any]:
    """`jobs.start_render`: the id from structuredContent or, for a server that answers JSON text, from `json`."""
    job: dict[str, Any] = {
        "job_id": "structuredContent.job_id || json.job_id",
        "status": {
            "tool": "render_status",
            "arguments": {"job_id": "{job_id}"},
            "state": "json.state",
            "states": RENDER_STATES,
            "message": "json.progress",
            "error": "json.error",
        },
        "result": {"tool": "render_result", "arguments": {"job_id": "{job_id}"}},
        "cancel": {"tool": "cancel_render", "arguments": {"job_id": "{job_id}"}},
        "poll_interval_ms": 100,
        "hide_helpers": True,
    }
    job.update(overrides)
    return {"start_render": job}


async def render_stats(client: Tasks) -> dict[str, int]:
    """What the fixture counted so far (starts, status_calls, cancels), asked through the proxy."""
    counts: dict[str, int] = json.loads(await client.text("render_stats", {}))
    return counts
