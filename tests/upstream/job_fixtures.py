"""A legacy job family, the shape long work had before Tasks: ``start_render`` answers a job id,
``render_status(job_id)`` says how far the job is (JSON as text: ``state`` queued → running → done / failed /
cancelled, ``progress``, ``error``), ``render_result(job_id)`` hands over the output and ``cancel_render(job_id)``
stops it. ``render_stats`` counts what was called (``starts``, ``status_calls``, ``cancels``), so a test sees
that a job was started once and how many polls the proxy made. Jobs run on the clock of this process alone;
they outlive any session (a proxy restart polls the same job on). Must not import proxy/.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from mcp import types
from mcp.server.fastmcp import FastMCP
from pydantic import Field

from tests.upstream.support import text_result

QUEUED_SECONDS = 0.1  # a job's first state is one the proxy's config need not name


@dataclass
class _Job:
    started_at: float
    seconds: float
    outcome: Literal["done", "failed", "cancelled"]
    flaky: bool
    cancelled: bool = False
    status_calls: int = 0

    def state(self) -> tuple[str, float]:
        elapsed = time.monotonic() - self.started_at
        if self.cancelled:
            return "cancelled", min(1.0, elapsed / self.seconds)
        if elapsed < QUEUED_SECONDS:
            return "queued", 0.0
        if elapsed < self.seconds:
            return "running", elapsed / self.seconds
        return self.outcome, 1.0


_jobs: dict[str, _Job] = {}
_counts = {"starts": 0, "status_calls": 0, "cancels": 0}


def _counted(counter: str, job_id: str) -> _Job | types.CallToolResult:
    """Count the call; the job, or the error answer for an id this server never gave."""
    _counts[counter] += 1
    job = _jobs.get(job_id)
    return job if job is not None else text_result(f"no such job: {job_id}", is_error=True)


def _structured(text: str, content: dict[str, Any]) -> types.CallToolResult:
    """A result with a prose text block and its structuredContent."""
    return types.CallToolResult(content=[types.TextContent(type="text", text=text)], structuredContent=content)


def register(mcp: FastMCP[Any]) -> None:
    """Register the job family on ``mcp``."""

    @mcp.tool(
        name="start_render",
        description="Starts a render job of `seconds` that ends `outcome`; answers its id in structuredContent "
        "(`answer: structured`, with a prose text block) or as JSON text only (`answer: text`). A `flaky` job's "
        "status tool fails every other call.",
    )
    async def start_render(
        seconds: Annotated[float, Field(description="How long the job runs", gt=0)] = 1.0,
        outcome: Annotated[Literal["done", "failed", "cancelled"], Field(description="How it ends")] = "done",
        answer: Annotated[Literal["structured", "text"], Field(description="How the id is answered")] = "structured",
        flaky: Annotated[bool, Field(description="The status tool fails every other call")] = False,
    ) -> types.CallToolResult:
        _counts["starts"] += 1
        job_id = f"render-{_counts['starts']}"
        _jobs[job_id] = _Job(time.monotonic(), seconds, outcome, flaky)
        if answer == "text":
            return text_result(json.dumps({"job_id": job_id}))
        return _structured(f"Render {job_id} started", {"job_id": job_id})

    @mcp.tool(name="render_status", description="The render job's state and progress, as JSON text")
    async def render_status(job_id: Annotated[str, Field(description="The job's id")]) -> types.CallToolResult:
        job = _counted("status_calls", job_id)
        if not isinstance(job, _Job):
            return job
        job.status_calls += 1
        if job.flaky and job.status_calls % 2 == 1:
            return text_result("the status backend is unavailable, try again", is_error=True)
        state, done = job.state()
        status: dict[str, Any] = {"state": state, "progress": f"{round(done * 100)}%"}
        if state == "failed":
            status["error"] = f"{job_id}: out of memory"
        return text_result(json.dumps(status))

    @mcp.tool(name="render_result", description="A finished render job's output")
    async def render_result(job_id: Annotated[str, Field(description="The job's id")]) -> types.CallToolResult:
        job = _jobs.get(job_id)
        if job is None or job.state()[0] != "done":
            return text_result(f"{job_id} has no output", is_error=True)
        return _structured(f"rendered {job_id}", {"job_id": job_id, "frames": 24})

    @mcp.tool(name="cancel_render", description="Stops a render job")
    async def cancel_render(job_id: Annotated[str, Field(description="The job's id")]) -> types.CallToolResult:
        job = _counted("cancels", job_id)
        if not isinstance(job, _Job):
            return job
        job.cancelled = True
        return text_result(f"{job_id} cancelled")

    @mcp.tool(name="render_stats", description="How often the job tools were called, as JSON text")
    async def render_stats() -> types.CallToolResult:
        return text_result(json.dumps(_counts))
