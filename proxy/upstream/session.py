"""What an upstream session is, whatever its kind: the `Session` protocol and the `SessionKind` that makes
them; who holds a session and who listens to it (`Lending`, `Subscribers`); what the upstream said most recently
(`Learned`); and what both kinds do alike on top of their own `call()`. Imports the caller's identity, the event
types, the auth decision and the wire; no aiohttp, no session kind, not the pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator, Mapping
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from typing import Any, Final, Protocol

import structlog

from proxy.errors import RequestId, UpstreamAuthError, UpstreamError, UpstreamTimeoutError
from proxy.observe.metrics import Metrics, method_label
from proxy.principals import Identity
from proxy.upstream.auth import UpstreamAuth
from proxy.upstream.credentials import Credentials
from proxy.wire import legacy_tasks
from proxy.wire.envelope import ParamHeader, param_headers
from proxy.wire.jsonrpc import JSON
from proxy.wire.translate import implementation
from proxy.wire.upstream_events import (
    UpstreamErrorResponse,
    UpstreamEvent,
    UpstreamNotification,
    UpstreamResult,
    UpstreamServerRequest,
    refusal,
)

log = structlog.get_logger(__name__)

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
        self,
        method: str,
        params: JSON | None,
        extra_headers: Mapping[str, str] | None = None,
        *,
        tool: str | None = None,
    ) -> AbstractAsyncContextManager[RequestStream]:
        """One request; `tool` names the tool it is about when the request does not (tasks/* of a tool's task),
        for a credential aimed at that tool (`upstream.credentials.exchange.tools`)."""

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
    - `keep_warm`: sessions are costly to start (stdio processes): a principal that borrows one gets a spare
      started in the background (so does the anonymous caller at start).
    - `limit_name`: the config field named by the limit error.
    - `refuse_new_calls_when_full`: a new call that would need a session the pool has no room for is refused
      at its start (`SessionPool.room_for`) instead of waiting for one in the pool: where sessions are held long
      by work that waits for clients (a task waiting for input holds its own), waiting seldom helps, and a task
      must not fail later for want of one.
    """

    max_idle: int
    max_open: int | None = None
    idle_seconds: float | None = None
    share_quiet_calls: bool = False
    keep_warm: bool = False
    wait_seconds: float = 5.0
    limit_name: str = "upstream.max_sessions"
    refuse_new_calls_when_full: bool = False


class Room(Protocol):
    """Room the pool keeps for sessions it does not hold (a legacy client's own stdio server process)."""

    async def reserve(self, make_room: Callable[[], None] | None = None) -> None: ...

    def unreserve(self) -> None: ...


class SessionKind(Protocol):
    """Makes the sessions of one kind of upstream, says how the pool bounds them, and keeps what they share:
    background work and what the upstream said most recently (`learned`)."""

    limits: PoolLimits
    learned: Learned
    auth: UpstreamAuth  # whether what one caller's session learned may serve another
    credentials: Credentials  # what each request presents for its caller, and what sessions are kept under

    def new(self, principal: Identity | None) -> Session: ...

    async def probe(self, max_age_seconds: float, shared: Callable[[], AbstractAsyncContextManager[Session]]) -> None:
        """Readiness: raise UpstreamError saying what is wrong. `shared` lends the anonymous shared session,
        for kinds whose sessions are too costly to start one just for a probe."""

    def spawn(self, coroutine: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]: ...

    async def close(self) -> None: ...


# --- who holds a session, and who listens to it ------------------------------------------------------------

Sink = Callable[[UpstreamEvent], Awaitable[None]]  # where a lent session's unsolicited traffic goes
Notifications = Callable[[UpstreamNotification], None]
Request = Callable[[str, JSON | None], Awaitable[JSON]]


class Respond(Protocol):
    async def __call__(
        self, request_id: RequestId, *, result: JSON | None = None, error: JSON | None = None
    ) -> None: ...


class Subscription(Protocol):
    """A listen stream's inbox for a session's notifications. `None` means: the proxy is shutting down, end
    the stream gracefully. `offer` must not block."""

    def offer(self, message: JSON | None) -> None: ...


class Subscribers:
    """The listen streams reading one session, and the resource subscriptions they hold upstream."""

    def __init__(self, request: Request, tools_changed: Callable[[], None]) -> None:
        self._request = request
        self._tools_changed = tools_changed
        self.subscriptions: set[Subscription] = set()
        self._resources: Counter[str] = Counter()

    def deliver(self, notification: UpstreamNotification) -> None:
        """A notification for the listen streams; a tool list change also drops the cached x-mcp-header
        annotations (of every session: they share one catalog)."""
        if notification.method == "notifications/tools/list_changed":
            self._tools_changed()
        for subscription in self.subscriptions:
            subscription.offer(notification.message)

    def subscribe(self, subscription: Subscription) -> None:
        self.subscriptions.add(subscription)

    def unsubscribe(self, subscription: Subscription) -> None:
        self.subscriptions.discard(subscription)

    def end(self) -> None:
        """Shutdown: every listen stream ends with its graceful result."""
        for subscription in self.subscriptions:
            subscription.offer(None)

    async def subscribe_resource(self, uri: str) -> None:
        """Reference-counted upstream `resources/subscribe` on behalf of listen streams."""
        if self._resources[uri] == 0:
            await self._request("resources/subscribe", {"uri": uri})
        self._resources[uri] += 1

    async def unsubscribe_resource(self, uri: str) -> None:
        if self._resources[uri] <= 0:
            return
        self._resources[uri] -= 1
        if self._resources[uri] == 0:
            del self._resources[uri]
            await self._request("resources/unsubscribe", {"uri": uri})

    @property
    def resources(self) -> list[str]:
        return list(self._resources)

    async def resubscribe(self) -> None:
        """A new upstream session knows none of the resource subscriptions listen streams still hold."""
        for uri in list(self._resources):
            try:
                await self._request("resources/subscribe", {"uri": uri})
            except UpstreamError as exc:
                log.warning("upstream_resource_resubscribe_failed", error=exc.message)


class Lending:
    """Who holds a session and where its unsolicited traffic goes. The pool lends a session to one call (`lend`:
    its sink, and where notifications go besides) and takes it back (`take_back`); `keep` marks a session whose
    upstream work outlives this process. `route` sends what the server sent naming no request to its place: a
    ping is answered; everything goes to the lessee while a call holds the session; a question nobody holds is
    refused at once (an elicitation is declined), so the upstream never waits; notifications also reach the
    listen streams."""

    def __init__(self, subscribers: Subscribers) -> None:
        self._subscribers = subscribers
        self.lessee: Sink | None = None  # the call that holds the session alone, if any
        self._notifications: Notifications = subscribers.deliver
        self.kept = False  # holds upstream work a later proxy process resumes: let go without ending it

    def lend(self, sink: Sink, notifications: Notifications) -> None:
        """The session serves one call alone: what arrives unasked goes to `sink`, notifications also to
        `notifications` (the principal's listen streams, which read its shared session)."""
        self.lessee = sink
        self._notifications = notifications

    def take_back(self) -> None:
        """The call is done with the session: questions naming no request are refused again. Notifications
        still go where the lease sent them, so a list change seen later reaches the principal's streams."""
        self.lessee = None

    @property
    def lent(self) -> bool:
        """A call holds the session alone right now."""
        return self.lessee is not None

    def keep(self) -> None:
        self.kept = True

    async def route(self, event: UpstreamEvent, respond: Respond, refused_because: str) -> None:
        if isinstance(event, UpstreamServerRequest) and event.method == "ping":
            await respond(event.id, result={})
            return
        if self.lessee is not None:
            await self.lessee(event)
        elif isinstance(event, UpstreamServerRequest):
            log.info("upstream_standalone_request_refused", input_method=event.method)
            result, error = refusal(event.method, f"{event.method} {refused_because}")
            await respond(event.id, result=result, error=error)
        if isinstance(event, UpstreamNotification):
            self._notifications(event)


# --- what the upstream said ------------------------------------------------------------------------------------

PARAM_HEADERS_REFRESH_SECONDS: Final = 5.0  # an unknown tool re-reads tools/list at most this often


class ToolCatalog:
    """One read of the upstream's tools/list: each tool's `x-mcp-header` annotations and `execution.taskSupport`.
    Stale once any session heard that the tool list changed (`Learned.tools_generation` moved on)."""

    def __init__(self) -> None:
        self.headers: dict[str, tuple[ParamHeader, ...]] | None = None
        self.task_support: dict[str, legacy_tasks.TaskSupport | None] = {}
        self.read_at = 0.0
        self.generation = 0

    def known_headers(self, tool: str, generation: int) -> tuple[ParamHeader, ...] | None:
        """The tool's annotations when this catalog can answer (it lists the tool, or was read too recently to
        read again); None when tools/list must be read."""
        if self.headers is None or generation != self.generation:
            return None
        if tool in self.headers:
            return self.headers[tool]
        if time.monotonic() - self.read_at > PARAM_HEADERS_REFRESH_SECONDS:
            return None
        return ()

    def read(
        self,
        headers: dict[str, tuple[ParamHeader, ...]],
        task_support: dict[str, legacy_tasks.TaskSupport | None],
        generation: int,
    ) -> None:
        self.headers = headers
        self.task_support = task_support
        self.read_at = time.monotonic()
        self.generation = generation


class Learned:
    """What the upstream said most recently, on any session of one kind: serverInfo and the whole
    InitializeResult (server/discover), the tool catalog every caller may share (when `auth` says so), and when
    it last answered (readiness). Every catalog goes stale when any session hears that the tool list changed."""

    def __init__(self) -> None:
        self.server_info: JSON | None = None
        self.initialize_result: JSON | None = None
        self.initialized_at = 0.0  # monotonic time of that initialize
        self.catalog = ToolCatalog()  # shared by every caller's sessions (the pool decides when it may serve)
        self.tools_generation = 0  # moves on whenever any session hears that the tool list changed
        self.last_answer_at: float | None = None  # monotonic time of the upstream's latest answer

    def initialized(self, result: JSON) -> None:
        self.server_info = implementation(result)
        self.initialize_result = result
        self.initialized_at = time.monotonic()

    def recent_initialize(self, max_age_ms: int) -> JSON | None:
        """The latest InitializeResult, if it is not older than `max_age_ms`."""
        if self.initialize_result is None or (time.monotonic() - self.initialized_at) * 1000 > max_age_ms:
            return None
        return self.initialize_result

    def known_headers(self, tool: str) -> tuple[ParamHeader, ...] | None:
        """The tool's annotations when the shared catalog can answer; None when tools/list must be read."""
        return self.catalog.known_headers(tool, self.tools_generation)

    def catalog_read(
        self, headers: dict[str, tuple[ParamHeader, ...]], task_support: dict[str, legacy_tasks.TaskSupport | None]
    ) -> None:
        """A fresh tools/list, for every session."""
        self.catalog.read(headers, task_support, self.tools_generation)

    def tools_changed(self) -> None:
        self.tools_generation += 1


@contextlib.contextmanager
def measured(metrics: Metrics | None, method: str) -> Iterator[None]:
    """One upstream request in the metrics: how long it took, and a failure by its kind."""
    started = time.perf_counter()
    try:
        yield
    except UpstreamError as exc:
        if metrics is not None:
            kind = "timeout" if isinstance(exc, UpstreamTimeoutError) else "unavailable"
            if isinstance(exc, UpstreamAuthError):
                kind = "refused"  # the caller's credential, not the upstream, was the problem
            metrics.upstream_errors.labels(method_label(method), kind).inc()
        raise
    finally:
        if metrics is not None:
            metrics.upstream_request_done(method_label(method), time.perf_counter() - started)


# --- what both kinds do alike ---------------------------------------------------------------------------


async def answer(stream: RequestStream, refuse_on: Session | None = None) -> UpstreamResult | UpstreamErrorResponse:
    """Read a request's stream until its answer (the result or the JSON-RPC error), which is returned. What comes
    before it is nobody's: notifications are dropped, and with `refuse_on` (the request's session) a question is
    refused at once, so the upstream never waits for an answer nobody would give."""
    async for event in stream.events():
        if isinstance(event, UpstreamResult | UpstreamErrorResponse):
            return event
        if isinstance(event, UpstreamServerRequest) and refuse_on is not None:
            result, error = refusal(event.method)
            await refuse_on.respond(event.id, result=result, error=error)
    raise UpstreamError(f"Upstream did not answer {stream.method}")  # pragma: no cover - events() raises first


async def request(session: Session, method: str, params: JSON | None) -> JSON:
    """A plain request whose stream carries nothing the caller needs: its result, or UpstreamError."""
    async with session.call(method, params) as call:
        final = await answer(call)
    if isinstance(final, UpstreamErrorResponse):
        raise UpstreamError(f"Upstream refused {method}: {final.error.get('message')}")
    return final.result


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


async def read_param_headers(session: Session, learned: Learned, tool: str) -> tuple[ParamHeader, ...]:
    """The `x-mcp-header` annotations of `tool`: from the catalog `learned` keeps when it can answer, else read from
    the session's tools/list (and cached for every session, with each tool's `execution.taskSupport`)."""
    known = learned.known_headers(tool)
    if known is not None:
        return known
    catalog, task_support = await read_tools(session)
    learned.catalog_read(catalog, task_support)
    return catalog.get(tool, ())


async def read_task_support(session: Session, learned: Learned, tool: str) -> legacy_tasks.TaskSupport | None:
    """How the upstream runs `tool` as its own 2025-11-25 task (`execution.taskSupport` from tools/list), or
    None when it runs none: the tool says nothing, or the upstream did not declare `tasks.requests.tools.call`.
    Read with the x-mcp-header annotations (and refreshed with them)."""
    initialize_result = await session.ensure_initialized()
    if not legacy_tasks.runs_tool_tasks(initialize_result):
        return None
    await read_param_headers(session, learned, tool)
    support = learned.catalog.task_support.get(tool)
    return support if support in ("optional", "required") else None
