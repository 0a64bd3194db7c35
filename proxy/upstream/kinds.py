"""What every kind of upstream session is, and what the kinds share.

An upstream session is the proxy's own legacy client connection to the server: a Streamable HTTP session
(`session.py`) or one stdio server process (`stdio_session.py`). The runner, the front and the pool see only
the `Session` protocol below, and the calls it opens as `SessionCall`s. A `SessionKind` makes sessions of one
kind and says how the pool must bound them (`PoolLimits`); `LinkBase` is what every kind's link shares.
`SessionFeatures` is what both kinds do alike on top of their own `call()`: listen-stream inboxes, the
`x-mcp-header` catalog from `tools/list`, and reference-counted resource subscriptions. Imports the event
types and the wire; no aiohttp, no session kind.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import hashlib
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator, Mapping
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from typing import Any, Final, Protocol

import structlog

from proxy.errors import RequestId, UpstreamAuthError, UpstreamError, UpstreamTimeoutError
from proxy.observability import Metrics, method_label
from proxy.upstream.auth import UpstreamAuth
from proxy.upstream.events import (
    UpstreamErrorResponse,
    UpstreamEvent,
    UpstreamNotification,
    UpstreamResult,
    UpstreamServerRequest,
    refusal,
)
from proxy.wire import legacy_tasks
from proxy.wire.envelope import ParamHeader, param_headers
from proxy.wire.jsonrpc import JSON
from proxy.wire.translate import implementation

log = structlog.get_logger(__name__)

# One upstream session may serve clients with different capabilities, so it declares the superset and the
# proxy refuses, per request, what the current client cannot take.
CLIENT_CAPABILITIES: Final[JSON] = {"elicitation": {"form": {}, "url": {}}, "sampling": {}, "roots": {}}

try:
    PROXY_VERSION = version("mcp-tasks-proxy")
except PackageNotFoundError:  # pragma: no cover - running from a source tree without metadata
    PROXY_VERSION = "0.0.0"

CLIENT_INFO: Final[JSON] = {"name": "mcp-tasks-proxy", "version": PROXY_VERSION}
PARAM_HEADERS_REFRESH_SECONDS: Final = 5.0  # an unknown tool re-reads tools/list at most this often
MAX_TOOL_PAGES: Final = 100  # bounds the pagination of tools/list when reading x-mcp-header annotations

Sink = Callable[[UpstreamEvent], Awaitable[None]]  # where a leased session's unsolicited traffic goes


def principal_key(principal: str | None) -> str:
    """Sessions are keyed by a hash of the principal header so tokens are not kept as dict keys in clear."""
    if not principal:
        return ""
    return hashlib.sha256(principal.encode()).hexdigest()


class Subscription(Protocol):
    """A listen stream's inbox for a session's notifications. `None` means: the proxy is shutting down, end
    the stream gracefully. `offer` must not block."""

    def offer(self, message: JSON | None) -> None: ...


class SessionCall(Protocol):
    """One request open on a session: what the upstream says about it, the final result or error last."""

    request_id: int
    method: str
    finished: bool

    def events(self) -> AsyncIterator[UpstreamEvent]: ...

    async def cancel(self, reason: str) -> None:
        """Tell the upstream (`notifications/cancelled`) and stop reading."""


class Session(Protocol):
    """One upstream session, of whichever kind. What arrives unsolicited (a question naming no request, a
    notification) goes to `lessee` while a call holds the session, else is refused (questions); notifications
    also go to `on_notification`."""

    principal: str | None
    session_id: str | None
    protocol_version: str
    initialize_result: JSON | None
    in_flight: int  # calls open on this session right now
    lessee: Sink | None
    subscriptions: set[Subscription]
    on_notification: Callable[[UpstreamNotification], None]
    kept: bool  # holds upstream work a later proxy process resumes: let go without ending it

    async def ensure_initialized(self) -> JSON: ...

    def call(
        self, method: str, params: JSON | None, extra_headers: Mapping[str, str] | None = None
    ) -> AbstractAsyncContextManager[SessionCall]: ...

    async def request(self, method: str, params: JSON | None) -> JSON: ...

    async def notify(self, method: str, params: JSON | None) -> None: ...

    async def respond(
        self, request_id: RequestId, *, result: JSON | None = None, error: JSON | None = None
    ) -> None: ...

    async def param_headers(self, tool: str) -> tuple[ParamHeader, ...]: ...

    async def task_support(self, tool: str) -> legacy_tasks.TaskSupport | None: ...

    def deliver(self, notification: UpstreamNotification) -> None: ...

    def subscribe(self, subscription: Subscription) -> None: ...

    def unsubscribe(self, subscription: Subscription) -> None: ...

    def end_subscriptions(self) -> None: ...

    async def subscribe_resource(self, uri: str) -> None: ...

    async def unsubscribe_resource(self, uri: str) -> None: ...

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


class SessionKind(Protocol):
    """Makes the sessions of one kind of upstream, and what they share (`LinkBase`: background work and what
    the upstream said most recently)."""

    limits: PoolLimits
    server_info: JSON | None
    initialize_result: JSON | None
    tool_task_support: dict[str, legacy_tasks.TaskSupport | None]
    auth: UpstreamAuth  # whether what one caller's session learned may serve another

    def recent_initialize(self, max_age_ms: int) -> JSON | None: ...

    def known_headers(self, tool: str) -> tuple[ParamHeader, ...] | None: ...

    def new(self, principal: str | None) -> Session: ...

    async def probe(self, max_age_seconds: float, shared: Callable[[], AbstractAsyncContextManager[Session]]) -> None:
        """Readiness: raise UpstreamError saying what is wrong. `shared` lends the anonymous shared session,
        for kinds whose sessions are too costly to start one just for a probe."""

    def spawn(self, coroutine: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]: ...

    async def close(self) -> None: ...


class LinkBase:
    """What every session of one upstream shares, whatever its kind: background work (named, referenced until
    done, cancelled on close: the one place `upstream/` starts background tasks) and what the upstream said
    most recently: serverInfo and the whole InitializeResult (server/discover), the `x-mcp-header` catalog of
    its tools with each tool's `execution.taskSupport` (dropped when any session hears that the tool list
    changed), and when it last answered (readiness)."""

    metrics: Metrics | None  # set by each kind's link

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[None]] = set()
        self.server_info: JSON | None = None
        self.initialize_result: JSON | None = None
        self.initialized_at = 0.0  # monotonic time of that initialize
        self.tool_headers: dict[str, tuple[ParamHeader, ...]] | None = None
        self.tool_task_support: dict[str, legacy_tasks.TaskSupport | None] = {}
        self.tool_headers_at = 0.0
        self.last_answer_at: float | None = None  # monotonic time of the upstream's latest answer
        self.auth = UpstreamAuth()  # a kind whose upstream can ask for credentials replaces it

    @contextlib.contextmanager
    def measured(self, method: str) -> Iterator[None]:
        """One upstream request in the metrics: how long it took, and a failure by its kind."""
        started = time.perf_counter()
        try:
            yield
        except UpstreamError as exc:
            if self.metrics is not None:
                kind = "timeout" if isinstance(exc, UpstreamTimeoutError) else "unavailable"
                if isinstance(exc, UpstreamAuthError):
                    kind = "refused"  # the caller's credential, not the upstream, was the problem
                self.metrics.upstream_errors.labels(method_label(method), kind).inc()
            raise
        finally:
            if self.metrics is not None:
                self.metrics.upstream_seconds.labels(method_label(method)).observe(time.perf_counter() - started)

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
        """The tool's annotations when the cached catalog can answer (it lists the tool, or was read too recently
        to read again); None when tools/list must be read."""
        if self.tool_headers is None:
            return None
        if tool in self.tool_headers:
            return self.tool_headers[tool]
        if time.monotonic() - self.tool_headers_at > PARAM_HEADERS_REFRESH_SECONDS:
            return None
        return ()

    def tools_changed(self) -> None:
        self.tool_headers = None

    def spawn(self, coroutine: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(coroutine, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._reap)
        return task

    def _reap(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("upstream_background_task_failed", task=task.get_name(), error=repr(task.exception()))

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


class SessionFeatures(abc.ABC):
    """What both kinds do alike on top of their own `call()`: listen inboxes, the tool catalog of
    `x-mcp-header` annotations (kept on the link, for every session), reference-counted resource subscriptions,
    and plain requests."""

    def __init__(self, link: LinkBase) -> None:
        self.link = link
        self.subscriptions: set[Subscription] = set()
        self._resource_subscriptions: Counter[str] = Counter()

    @abc.abstractmethod
    def call(
        self, method: str, params: JSON | None, extra_headers: Mapping[str, str] | None = None
    ) -> AbstractAsyncContextManager[SessionCall]: ...

    @abc.abstractmethod
    async def ensure_initialized(self) -> JSON: ...

    async def request(self, method: str, params: JSON | None) -> JSON:
        """A plain request whose stream carries nothing the caller needs: its result, or UpstreamError."""
        async with self.call(method, params) as call:
            async for event in call.events():
                if isinstance(event, UpstreamResult):
                    return event.result
                if isinstance(event, UpstreamErrorResponse):
                    raise UpstreamError(f"Upstream refused {method}: {event.error.get('message')}")
        raise UpstreamError(f"Upstream did not answer {method}")  # pragma: no cover - events() raises first

    # --- what the server sends unasked -----------------------------------------------------------------

    lessee: Sink | None  # the call that holds the session alone, if any
    on_notification: Callable[[UpstreamNotification], None]

    @abc.abstractmethod
    async def respond(
        self, request_id: RequestId, *, result: JSON | None = None, error: JSON | None = None
    ) -> None: ...

    async def route_unsolicited(self, event: UpstreamEvent, refused_because: str) -> None:
        """Something the server sent naming no request: a ping is answered; everything goes to the lessee
        while a call holds the session alone; a question nobody holds is refused at once (an elicitation
        declined), so the upstream never waits; notifications also reach `on_notification` (listen streams)."""
        if isinstance(event, UpstreamServerRequest) and event.method == "ping":
            await self.respond(event.id, result={})
            return
        if self.lessee is not None:
            await self.lessee(event)
        elif isinstance(event, UpstreamServerRequest):
            log.info("upstream_standalone_request_refused", input_method=event.method)
            result, error = refusal(event.method, f"{event.method} {refused_because}")
            await self.respond(event.id, result=result, error=error)
        if isinstance(event, UpstreamNotification):
            self.on_notification(event)

    # --- listen streams --------------------------------------------------------------------------------

    def deliver(self, notification: UpstreamNotification) -> None:
        """A notification for this session's listen subscribers; a tool list change also drops the cached
        x-mcp-header annotations (of every session: they share one catalog)."""
        if notification.method == "notifications/tools/list_changed":
            self.link.tools_changed()
        for subscription in self.subscriptions:
            subscription.offer(notification.message)

    def subscribe(self, subscription: Subscription) -> None:
        self.subscriptions.add(subscription)

    def unsubscribe(self, subscription: Subscription) -> None:
        self.subscriptions.discard(subscription)

    def end_subscriptions(self) -> None:
        for subscription in self.subscriptions:
            subscription.offer(None)

    # --- the tool catalog ------------------------------------------------------------------------------

    async def param_headers(self, tool: str) -> tuple[ParamHeader, ...]:
        """The `x-mcp-header` annotations of `tool`: from the cached catalog when it can answer, else read from
        this session's tools/list (and cached for every session, with each tool's `execution.taskSupport`)."""
        known = self.link.known_headers(tool)
        if known is not None:
            return known
        catalog: dict[str, tuple[ParamHeader, ...]] = {}
        task_support: dict[str, legacy_tasks.TaskSupport | None] = {}
        cursor: str | None = None
        for _ in range(MAX_TOOL_PAGES):
            page = await self.request("tools/list", {"cursor": cursor} if cursor else None)
            for listed in page.get("tools") or []:
                if isinstance(listed, dict) and isinstance(listed.get("name"), str):
                    catalog[listed["name"]] = param_headers(listed.get("inputSchema"))
                    task_support[listed["name"]] = legacy_tasks.tool_task_support(listed)
            cursor = page.get("nextCursor") if isinstance(page.get("nextCursor"), str) else None
            if cursor is None:
                break
        self.link.tool_headers = catalog
        self.link.tool_task_support = task_support
        self.link.tool_headers_at = time.monotonic()
        return catalog.get(tool, ())

    async def task_support(self, tool: str) -> legacy_tasks.TaskSupport | None:
        """How the upstream runs `tool` as its own 2025-11-25 task (`execution.taskSupport` from tools/list),
        or None when it runs none: the tool says nothing, or the upstream did not declare
        `tasks.requests.tools.call`. Read with the x-mcp-header annotations (and refreshed with them)."""
        initialize_result = await self.ensure_initialized()
        if not legacy_tasks.runs_tool_tasks(initialize_result):
            return None
        await self.param_headers(tool)
        support = self.link.tool_task_support.get(tool)
        return support if support in ("optional", "required") else None

    # --- resource subscriptions ---------------------------------------------------------------------------

    async def subscribe_resource(self, uri: str) -> None:
        """Reference-counted upstream `resources/subscribe` on behalf of listen streams."""
        if self._resource_subscriptions[uri] == 0:
            await self.request("resources/subscribe", {"uri": uri})
        self._resource_subscriptions[uri] += 1

    async def unsubscribe_resource(self, uri: str) -> None:
        if self._resource_subscriptions[uri] <= 0:
            return
        self._resource_subscriptions[uri] -= 1
        if self._resource_subscriptions[uri] == 0:
            del self._resource_subscriptions[uri]
            await self.request("resources/unsubscribe", {"uri": uri})

    @property
    def resource_subscriptions(self) -> list[str]:
        return list(self._resource_subscriptions)

    async def resubscribe(self) -> None:
        """A new upstream session knows none of the resource subscriptions listen streams still hold."""
        for uri in list(self._resource_subscriptions):
            try:
                await self.request("resources/subscribe", {"uri": uri})
            except UpstreamError as exc:
                log.warning("upstream_resource_resubscribe_failed", error=exc.message)
