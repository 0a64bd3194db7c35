"""What an upstream session is, whatever its kind: the one description (`Session`), and what both kinds do
alike through it.

An upstream session is the proxy's own legacy client connection to the server: a Streamable HTTP session
(`http/session.py`) or one stdio server process (`stdio/session.py`). The runner, the front and the pool see
only the `Session` protocol below, and the requests it opens as `RequestStream`s. A `SessionKind` makes the
sessions of one kind and says how the pool must bound them (`PoolLimits`); which server legacy clients get is
chosen above this package (`legacy/serving.py`). `request`, `read_tools`, `read_param_headers` and
`read_task_support` are what both kinds do alike on top of their own `call()`. Imports the caller's identity,
the event types, the shared state, the lending, the auth decision and the wire; no aiohttp, no session kind,
not the pool.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from typing import Any, Final, Protocol

from proxy.errors import RequestId, UpstreamError
from proxy.principals import Identity
from proxy.upstream.auth import UpstreamAuth
from proxy.upstream.lending import Lending, Subscribers
from proxy.upstream.shared import SharedBase, ToolCatalog
from proxy.wire import legacy_tasks
from proxy.wire.envelope import ParamHeader, param_headers
from proxy.wire.jsonrpc import JSON
from proxy.wire.upstream_events import UpstreamErrorResponse, UpstreamEvent, UpstreamResult

# One upstream session may serve clients with different capabilities, so it declares the superset and the
# proxy refuses, per request, what the current client cannot take.
CLIENT_CAPABILITIES: Final[JSON] = {"elicitation": {"form": {}, "url": {}}, "sampling": {}, "roots": {}}

try:
    PROXY_VERSION = version("mcp-tasks-proxy")
except PackageNotFoundError:  # pragma: no cover - running from a source tree without metadata
    PROXY_VERSION = "0.0.0"

CLIENT_INFO: Final[JSON] = {"name": "mcp-tasks-proxy", "version": PROXY_VERSION}
MAX_TOOL_PAGES: Final = 100  # bounds the pagination of tools/list when reading x-mcp-header annotations


class RequestStream(Protocol):
    """One request open on a session: what the upstream says about it, the final result or error last."""

    request_id: int
    method: str
    finished: bool

    def events(self) -> AsyncIterator[UpstreamEvent]: ...

    async def cancel(self, reason: str) -> None:
        """Tell the upstream (`notifications/cancelled`) and stop reading."""


class Session(Protocol):
    """One upstream session, of whichever kind. What arrives unasked (a question naming no request, a
    notification) goes to the call it is lent to (`lending.lend`, until `lending.take_back`), else is refused
    (questions); notifications also reach the listen streams (`subscribers`)."""

    principal: Identity | None
    session_id: str | None
    protocol_version: str
    initialize_result: JSON | None
    in_flight: int  # calls open on this session right now
    subscribers: Subscribers
    lending: Lending  # who holds the session alone, where its unasked traffic goes, whether it is kept

    async def ensure_initialized(self) -> JSON: ...

    def call(
        self, method: str, params: JSON | None, extra_headers: Mapping[str, str] | None = None
    ) -> AbstractAsyncContextManager[RequestStream]: ...

    async def request(self, method: str, params: JSON | None) -> JSON: ...

    async def notify(self, method: str, params: JSON | None) -> None: ...

    async def respond(
        self, request_id: RequestId, *, result: JSON | None = None, error: JSON | None = None
    ) -> None: ...

    async def param_headers(self, tool: str) -> tuple[ParamHeader, ...]: ...

    async def task_support(self, tool: str) -> legacy_tasks.TaskSupport | None: ...

    async def adopt(self, session_id: str) -> None:
        """Take over a session an earlier proxy process initialized (it holds a task the upstream runs)."""

    def detach(self) -> None:
        """Let go of the session without ending its upstream work where the kind allows that."""

    async def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class PoolLimits:
    """How the pool treats one kind's sessions.

    - `max_idle`: idle sessions kept for reuse; beyond it the least recently used one is closed.
    - `max_open`: sessions at once, busy ones included (None: unbounded, the call limits bound them); a new
      one beyond it first closes an idle one, else waits up to `wait_seconds`, then fails with a limit error.
    - `idle_seconds`: a lent session idle this long is closed (None: kept until evicted).
    - `share_quiet_calls`: a call whose client could not answer a question runs on the principal's shared
      session (multiplexed) instead of a session of its own.
    - `limit_name`: the config field named by the limit error.
    """

    max_idle: int
    max_open: int | None = None
    idle_seconds: float | None = None
    share_quiet_calls: bool = False
    wait_seconds: float = 5.0
    limit_name: str = "upstream.max_sessions"


class Room(Protocol):
    """Room the pool keeps for sessions it does not hold (a legacy client's own stdio server process)."""

    async def reserve(self, make_room: Callable[[], None] | None = None) -> None: ...

    def unreserve(self) -> None: ...


class SessionKind(Protocol):
    """Makes the sessions of one kind of upstream, and what they share (`SharedBase`: background work and what
    the upstream said most recently)."""

    limits: PoolLimits
    server_info: JSON | None
    initialize_result: JSON | None
    catalog: ToolCatalog  # the tool catalog every caller shares (when `auth` says it may)
    tools_generation: int  # moves on when the tool list changed: every catalog read before is stale
    auth: UpstreamAuth  # whether what one caller's session learned may serve another

    def recent_initialize(self, max_age_ms: int) -> JSON | None: ...

    def known_headers(self, tool: str) -> tuple[ParamHeader, ...] | None: ...

    def new(self, principal: Identity | None) -> Session: ...

    async def probe(self, max_age_seconds: float, shared: Callable[[], AbstractAsyncContextManager[Session]]) -> None:
        """Readiness: raise UpstreamError saying what is wrong. `shared` lends the anonymous shared session,
        for kinds whose sessions are too costly to start one just for a probe."""

    def spawn(self, coroutine: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]: ...

    async def close(self) -> None: ...


# --- what both kinds do alike ---------------------------------------------------------------------------


async def request(session: Session, method: str, params: JSON | None) -> JSON:
    """A plain request whose stream carries nothing the caller needs: its result, or UpstreamError."""
    async with session.call(method, params) as call:
        async for event in call.events():
            if isinstance(event, UpstreamResult):
                return event.result
            if isinstance(event, UpstreamErrorResponse):
                raise UpstreamError(f"Upstream refused {method}: {event.error.get('message')}")
    raise UpstreamError(f"Upstream did not answer {method}")  # pragma: no cover - events() raises first


async def read_tools(
    session: Session,
) -> tuple[dict[str, tuple[ParamHeader, ...]], dict[str, legacy_tasks.TaskSupport | None]]:
    """The session's whole tools/list (at most MAX_TOOL_PAGES pages): each tool's `x-mcp-header` annotations and
    its `execution.taskSupport`."""
    catalog: dict[str, tuple[ParamHeader, ...]] = {}
    task_support: dict[str, legacy_tasks.TaskSupport | None] = {}
    cursor: str | None = None
    for _ in range(MAX_TOOL_PAGES):
        page = await session.request("tools/list", {"cursor": cursor} if cursor else None)
        for listed in page.get("tools") or []:
            if isinstance(listed, dict) and isinstance(listed.get("name"), str):
                catalog[listed["name"]] = param_headers(listed.get("inputSchema"))
                task_support[listed["name"]] = legacy_tasks.tool_task_support(listed)
        cursor = page.get("nextCursor") if isinstance(page.get("nextCursor"), str) else None
        if cursor is None:
            break
    return catalog, task_support


async def read_param_headers(session: Session, shared: SharedBase, tool: str) -> tuple[ParamHeader, ...]:
    """The `x-mcp-header` annotations of `tool`: from the shared state's catalog when it can answer, else read from
    the session's tools/list (and cached for every session, with each tool's `execution.taskSupport`)."""
    known = shared.known_headers(tool)
    if known is not None:
        return known
    catalog, task_support = await read_tools(session)
    shared.catalog_read(catalog, task_support)
    return catalog.get(tool, ())


async def read_task_support(session: Session, shared: SharedBase, tool: str) -> legacy_tasks.TaskSupport | None:
    """How the upstream runs `tool` as its own 2025-11-25 task (`execution.taskSupport` from tools/list), or
    None when it runs none: the tool says nothing, or the upstream did not declare `tasks.requests.tools.call`.
    Read with the x-mcp-header annotations (and refreshed with them)."""
    initialize_result = await session.ensure_initialized()
    if not legacy_tasks.runs_tool_tasks(initialize_result):
        return None
    await read_param_headers(session, shared, tool)
    support = shared.catalog.task_support.get(tool)
    return support if support in ("optional", "required") else None
