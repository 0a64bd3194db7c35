"""Fixtures for task handles: ``long_report`` (long work with an ``outputSchema``, an optional elicitation
mid-call, progress), ``report_state`` (what became of each of its runs) and ``clash_task_status`` (the name of a
synthesised tool under the prefix `clash_`). A run's story is written to a file
per key under the system's temporary directory, so that a test reads it whatever process served the run (a
stdio upstream runs one process per session).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Annotated, Any

import anyio
from mcp import types
from mcp.server.fastmcp import FastMCP
from pydantic import BaseModel, Field

from tests.upstream import support
from tests.upstream.support import Ctx, elicit, text_result

REPORTS = Path(tempfile.gettempdir()) / "mcp-fixture-reports"
KEY_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"
PROGRESS_EVERY_S = 0.5


class Report(BaseModel):
    key: str
    runs: int
    approved: bool | None = None


def story(key: str) -> list[str]:
    """What happened to the runs of `key`, in order: started, asked, answered, cancelled, finished."""
    path = REPORTS / key
    return path.read_text().split() if path.exists() else []


def _tell(key: str, what: str) -> None:
    REPORTS.mkdir(exist_ok=True)
    with (REPORTS / key).open("a") as file:
        file.write(what + "\n")


def register(mcp: FastMCP[Any]) -> None:
    """Register the handle fixtures on ``mcp``."""

    @mcp.tool(
        name="long_report",
        description="Works `seconds` on report `key` (cancellable, progress every 0.5 s), first asking whether to "
        "approve it when `ask`; returns the report as structured output",
        structured_output=True,
    )
    async def long_report(
        ctx: Ctx,
        key: Annotated[str, Field(description="The report's name", pattern=KEY_PATTERN)],
        seconds: Annotated[float, Field(description="How long to work, in seconds", ge=0)] = 0,
        ask: Annotated[bool, Field(description="Ask for approval first")] = False,
    ) -> Report:
        support.call_started("long_report")
        runs = story(key).count("started") + 1
        _tell(key, "started")
        approved: bool | None = None
        try:
            if ask:
                _tell(key, "asked")
                schema = {"type": "object", "properties": {"approve": {"type": "boolean"}}, "required": ["approve"]}
                answer = await elicit(ctx, f"Approve report {key}?", schema)
                approved = answer.action == "accept" and bool((answer.content or {}).get("approve"))
                _tell(key, "answered")
            start = anyio.current_time()
            while (remaining := seconds - (anyio.current_time() - start)) > 0:
                await anyio.sleep(min(PROGRESS_EVERY_S, remaining))
                await ctx.report_progress(round(min(seconds, anyio.current_time() - start), 3), seconds)
        except anyio.get_cancelled_exc_class():
            _tell(key, "cancelled")
            raise
        _tell(key, "finished")
        return Report(key=key, runs=runs, approved=approved)

    @mcp.tool(name="report_state", description="JSON list: what happened to the runs of `long_report` for `key`")
    async def report_state(
        key: Annotated[str, Field(description="The report's name", pattern=KEY_PATTERN)],
    ) -> types.CallToolResult:
        return text_result(json.dumps(story(key)))

    @mcp.tool(name="clash_task_status", description="A tool whose name is taken by the handles' prefix `clash_`")
    async def clash_task_status() -> types.CallToolResult:
        return text_result("the upstream's own clash_task_status")
