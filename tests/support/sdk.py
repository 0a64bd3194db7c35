"""The mcp 1.x SDK's own client, as a legacy (2025-11-25) client of an upstream or of the proxy: a connection
that keeps every notification, one session's observable behaviour to compare direct and proxied runs, and
the fixture upstream's own count of the calls it has started."""

from __future__ import annotations

import json
import warnings
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import httpx
import mcp.types as mt
from mcp import ClientSession
from mcp.client.experimental.tasks import ExperimentalClientFeatures
from mcp.client.session import ElicitationFnT
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.context import RequestContext
from mcp.shared.exceptions import McpError
from mcp.shared.session import RequestResponder
from pydantic import AnyUrl

from tests.support.waiting import until

READ_TIMEOUT = timedelta(seconds=20)  # a lost answer fails the test instead of hanging it


@dataclass
class Connection:
    session: ClientSession
    init: mt.InitializeResult
    tasks: ExperimentalClientFeatures
    notifications: list[mt.ServerNotification] = field(default_factory=list)

    def seen(self, kind: type[Any]) -> list[Any]:
        return [note.root for note in self.notifications if isinstance(note.root, kind)]


@asynccontextmanager
async def connect(
    url: str, elicit: ElicitationFnT | None = None, headers: dict[str, str] | None = None
) -> AsyncIterator[Connection]:
    """One SDK client session (its requests carrying `headers`); every server notification it receives is kept
    on the connection."""
    notifications: list[mt.ServerNotification] = []

    async def on_message(
        message: RequestResponder[mt.ServerRequest, mt.ClientResult] | mt.ServerNotification | Exception,
    ) -> None:
        if isinstance(message, mt.ServerNotification):
            notifications.append(message)

    http = httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(30, read=300), follow_redirects=True)
    async with (
        http,
        streamable_http_client(url, http_client=http) as (read, write, _),
        ClientSession(read, write, READ_TIMEOUT, elicitation_callback=elicit, message_handler=on_message) as session,
    ):
        init = await session.initialize()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # mcp 1.x marks the experimental tasks API so
            tasks = session.experimental
        yield Connection(session, init, tasks, notifications)


def text(result: mt.CallToolResult) -> str:
    return "".join(block.text for block in result.content if isinstance(block, mt.TextContent))


async def _elicit(context: RequestContext[ClientSession, Any], params: mt.ElicitRequestParams) -> mt.ElicitResult:
    return mt.ElicitResult(action="accept", content={"name": "Grace"})


async def _sample(
    context: RequestContext[ClientSession, Any], params: mt.CreateMessageRequestParams
) -> mt.CreateMessageResult:
    return mt.CreateMessageResult(
        role="assistant", content=mt.TextContent(type="text", text="sampled!"), model="test-model"
    )


async def run_session(url: str) -> dict[str, Any]:
    """What a legacy client observes in one session; compared between direct and proxied runs."""
    seen: list[float] = []

    async def on_progress(progress: float, total: float | None, message: str | None) -> None:
        seen.append(progress)

    async with (
        streamable_http_client(url) as (read, write, get_session_id),
        ClientSession(read, write, elicitation_callback=_elicit, sampling_callback=_sample) as session,
    ):
        init = await session.initialize()
        tools = await session.list_tools()
        greet = await session.call_tool("greet", {"name": "Ada"})
        asked = await session.call_tool("ask_name", {})
        sampled = await session.call_tool("sample", {"prompt": "hi"})
        slept = await session.call_tool("sleep", {"seconds": 0.3}, progress_callback=on_progress)
        try:
            await session.call_tool("raise_error", {"message": "bad", "code": -32000})
        except McpError as exc:
            error = exc.error
        resource = await session.read_resource(AnyUrl("test://static-text"))
        assert get_session_id() is not None
    return {
        "protocol": init.protocolVersion,
        "server": init.serverInfo.name,
        "tools": sorted(tool.name for tool in tools.tools),
        "greet": greet.model_dump(mode="json"),
        "asked": asked.model_dump(mode="json"),
        "sampled": sampled.model_dump(mode="json"),
        "slept": slept.model_dump(mode="json"),
        "progress_seen": bool(seen),
        "error": error.model_dump(mode="json"),
        "resource": resource.model_dump(mode="json"),
    }


async def calls_started(url: str, tool: str) -> int:
    """How many calls of `tool` (`sleep` or `counted`) the fixture upstream at `url` has started, asked directly."""
    async with connect(url) as conn:
        started: dict[str, int] = json.loads(text(await conn.session.call_tool("calls_started", {})))
    return started.get(tool, 0)


async def until_started_upstream(url: str, tool: str, more_than: int, timeout_seconds: float = 10) -> None:
    """Wait until the fixture upstream at `url` has started more than `more_than` calls of `tool`: the call a test
    sent is running upstream, not merely sent."""
    async with connect(url) as conn:

        async def started() -> bool:
            counts: dict[str, int] = json.loads(text(await conn.session.call_tool("calls_started", {})))
            return counts.get(tool, 0) > more_than

        await until(started, f"the upstream never started another {tool} call", timeout_seconds)


async def held_at_once(url: str, *, reset: bool = False) -> dict[str, int]:
    """The fixture upstream's `held` calls running now and the most that ran at once (`now`, `most`), asked
    directly; `reset` starts the most afresh."""
    async with connect(url) as conn:
        counts: dict[str, int] = json.loads(text(await conn.session.call_tool("held_at_once", {"reset": reset})))
    return counts
