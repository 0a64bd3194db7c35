"""The proxy as a legacy MCP client: upstream sessions, one POST per request, re-initialize on 404.

A session owns `initialize` + `notifications/initialized`, the `Mcp-Session-Id` and negotiated
`MCP-Protocol-Version` headers, its GET stream (`listener.py`) and where what arrives there goes: to the call
that leased the session, to `subscriptions/listen` inboxes, or refused. What every session shares (the HTTP
client, the URL, timeouts, request ids, the upstream's latest serverInfo) is the `UpstreamLink`; the pool that
hands sessions out is `pool.py`. aiohttp failures become UpstreamError. Imports aiohttp; never the store or
the front.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import json
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Mapping
from importlib.metadata import PackageNotFoundError, version
from typing import Any, Final, Protocol

import aiohttp
import structlog
from yarl import URL

from proxy.config import UpstreamConfig
from proxy.errors import RequestId, ResultTooLargeError, UpstreamError, UpstreamRefusedError, UpstreamTimeoutError
from proxy.observability import Metrics, method_label
from proxy.upstream.call import UpstreamCall, read_body
from proxy.upstream.events import (
    UpstreamErrorResponse,
    UpstreamEvent,
    UpstreamNotification,
    UpstreamResult,
    UpstreamServerRequest,
    refusal,
)
from proxy.upstream.listener import SessionGone, StreamEvent, UpstreamListener
from proxy.upstream.sse import EventTooLargeError
from proxy.wire import legacy_tasks
from proxy.wire.envelope import ParamHeader, param_headers
from proxy.wire.jsonrpc import JSON, dumps, error_message, notification_message, request_message, result_message
from proxy.wire.translate import implementation

log = structlog.get_logger(__name__)

# One upstream session may serve clients with different capabilities, so it declares the superset and the
# proxy refuses, per request, what the current client cannot take.
CLIENT_CAPABILITIES: Final[JSON] = {"elicitation": {"form": {}, "url": {}}, "sampling": {}, "roots": {}}

try:
    PROXY_VERSION = version("mcp-tasks-proxy")
except PackageNotFoundError:  # pragma: no cover - running from a source tree without metadata
    PROXY_VERSION = "0.0.0"

PARAM_HEADERS_REFRESH_SECONDS: Final = 5.0  # an unknown tool re-reads tools/list at most this often
MAX_TOOL_PAGES: Final = 100  # bounds the pagination of tools/list when reading x-mcp-header annotations
STANDALONE_REFUSED: Final = "cannot be relayed to 2026-07-28 clients: no call of theirs holds this upstream session"

CLIENT_INFO: Final[JSON] = {"name": "mcp-tasks-proxy", "version": PROXY_VERSION}

Sink = Callable[[UpstreamEvent], Awaitable[None]]  # where a leased session's GET-stream traffic goes


def principal_key(principal: str | None) -> str:
    """Sessions are keyed by a hash of the principal header so tokens are not kept as dict keys in clear."""
    if not principal:
        return ""
    return hashlib.sha256(principal.encode()).hexdigest()


class UpstreamLink:
    """What every session of one upstream shares: the HTTP client and URL, timeouts, request ids, background
    work, and what the upstream said most recently (serverInfo; when it last answered, for readiness)."""

    def __init__(
        self,
        config: UpstreamConfig,
        http: aiohttp.ClientSession,
        principal_header: str,
        metrics: Metrics | None,
        max_result_bytes: int | None = None,
    ) -> None:
        self.config = config
        self.max_result_bytes = max_result_bytes  # the largest upstream answer or stream message read
        self.http = http
        self.principal_header = principal_header
        self.metrics = metrics
        self.url = URL(config.url)  # parsed once, not per request
        self.timeout = aiohttp.ClientTimeout(
            total=config.call_timeout_seconds,
            connect=config.connect_timeout_seconds,
            sock_connect=config.connect_timeout_seconds,
        )
        self.server_info: JSON | None = None  # the upstream's serverInfo from the latest initialize
        self.initialize_result: JSON | None = None  # ... and its whole InitializeResult (server/discover)
        self.initialized_at = 0.0  # monotonic time of that initialize
        # The x-mcp-header annotations of the upstream's tools, read from tools/list (any session's), dropped when
        # any session hears that the tool list changed.
        self.tool_headers: dict[str, tuple[ParamHeader, ...]] | None = None
        self.tool_task_support: dict[str, legacy_tasks.TaskSupport | None] = {}  # read with the annotations
        self.tool_headers_at = 0.0
        self.last_answer_at: float | None = None  # monotonic time of the upstream's latest HTTP answer
        self._ids = itertools.count(1)
        self._tasks: set[asyncio.Task[None]] = set()

    def next_id(self) -> int:
        return next(self._ids)

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
        """The one place `upstream/` starts background work: named, referenced until done, cancelled on close."""
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


class Subscription(Protocol):
    """A listen stream's inbox for this session's notifications. `None` means: the proxy is shutting down, end
    the stream gracefully. `offer` must not block."""

    def offer(self, message: JSON | None) -> None: ...


class UpstreamSession:
    def __init__(self, link: UpstreamLink, principal: str | None) -> None:
        self.link = link
        self.principal = principal
        self.session_id: str | None = None
        self.protocol_version: str = link.config.protocol_version
        self.initialize_result: JSON | None = None
        self.in_flight = 0  # calls open on this session right now
        self.lessee: Sink | None = None  # the call that leased the session: its GET-stream traffic goes there
        self.subscriptions: set[Subscription] = set()
        # Where notifications from the GET stream go besides the lessee: this session's own listen subscribers,
        # unless the pool sends them to the principal's shared session (which the listen streams read).
        self.on_notification: Callable[[UpstreamNotification], None] = self.deliver
        self._listener: UpstreamListener | None = None
        self._lock = asyncio.Lock()
        self._resource_subscriptions: Counter[str] = Counter()
        self.kept = False  # holds upstream work a later proxy process resumes: never ended with DELETE

    # --- headers and plumbing -------------------------------------------------------------------------

    def headers(self, extra: Mapping[str, str] | None = None, *, initialized: bool = True) -> dict[str, str]:
        """Headers of a request on this session. The operator's `upstream.headers` come after the caller's
        principal header, so a configured credential wins (as it does on the pass-through)."""
        headers = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}
        if self.principal:
            headers[self.link.principal_header] = self.principal
        headers.update(self.link.config.headers)
        if initialized:
            headers["MCP-Protocol-Version"] = self.protocol_version
            if self.session_id is not None:
                headers["Mcp-Session-Id"] = self.session_id
        if extra:
            headers.update(extra)
        return headers

    def stream_headers(self, last_event_id: str | None) -> dict[str, str]:
        """Headers of a GET that opens (or resumes) an SSE stream of this session."""
        headers = self.headers({"Accept": "text/event-stream"})
        headers.pop("Content-Type", None)
        if last_event_id is not None:
            headers["Last-Event-ID"] = last_event_id
        return headers

    async def _post(self, message: JSON, headers: Mapping[str, str]) -> aiohttp.ClientResponse:
        link = self.link
        try:
            response = await link.http.post(link.url, data=dumps(message), headers=headers, timeout=link.timeout)
        except TimeoutError:
            raise UpstreamTimeoutError("Upstream MCP server did not answer in time") from None
        except aiohttp.ClientError as exc:
            raise UpstreamError("Upstream MCP server unavailable", detail=str(exc)) from None
        if response.status < 500:
            link.last_answer_at = time.monotonic()  # the upstream is there and speaks HTTP (readiness)
        return response

    # --- lifecycle --------------------------------------------------------------------------------------

    async def ensure_initialized(self) -> JSON:
        if self.initialize_result is not None:
            return self.initialize_result
        async with self._lock:
            if self.initialize_result is None:
                await self.initialize()
            assert self.initialize_result is not None
            return self.initialize_result

    async def initialize(self, *, listen: bool = True) -> None:
        self.session_id = None
        request_id = self.link.next_id()
        params = {
            "protocolVersion": self.link.config.protocol_version,
            "capabilities": CLIENT_CAPABILITIES,
            "clientInfo": CLIENT_INFO,
        }
        response = await self._post(request_message(request_id, "initialize", params), self.headers(initialized=False))
        session_id = response.headers.get("Mcp-Session-Id")
        if response.status >= 400:
            body = await response.text()
            response.release()
            raise UpstreamError(f"Upstream refused initialize: HTTP {response.status}", detail=body[:200])
        call = UpstreamCall(self, request_id, "initialize", response, self.link.max_result_bytes)
        result: JSON | None = None
        async for event in call.events():
            if isinstance(event, UpstreamResult):
                result = event.result
            elif isinstance(event, UpstreamErrorResponse):
                raise UpstreamError(f"Upstream refused initialize: {event.error.get('message')}")
        if result is None or not isinstance(result.get("protocolVersion"), str):
            raise UpstreamError("Upstream sent an invalid InitializeResult")
        self.session_id = session_id
        self.protocol_version = result["protocolVersion"]
        await self.notify("notifications/initialized", None)
        self.initialize_result = result
        self.link.server_info = implementation(result)
        self.link.initialize_result = result
        self.link.initialized_at = time.monotonic()
        if listen and session_id is not None:  # a stateless upstream has no standalone stream
            self._stop_listening()
            self._listener = UpstreamListener(
                session_id, self._open_stream, self._on_stream, self.link.max_result_bytes
            )
            await self._listener.start(self.link.spawn, self.link.config.connect_timeout_seconds)
        log.info("upstream_session_initialized", protocol_version=self.protocol_version, stateful=bool(session_id))
        if self._resource_subscriptions:
            # Not awaited here: initialize runs under the session lock, and these requests may need it.
            self.link.spawn(self._resubscribe(), "upstream-resubscribe")

    async def _open_stream(self, last_event_id: str | None) -> aiohttp.ClientResponse:
        timeout = aiohttp.ClientTimeout(total=None, connect=self.link.config.connect_timeout_seconds)
        return await self.link.http.get(self.link.url, headers=self.stream_headers(last_event_id), timeout=timeout)

    def _stop_listening(self) -> None:
        if self._listener is not None:
            self._listener.stop()
            self._listener = None

    async def _resubscribe(self) -> None:
        """A new session knows none of the resource subscriptions listen streams still hold: renew them."""
        for uri in list(self._resource_subscriptions):
            try:
                await self.request("resources/subscribe", {"uri": uri})
            except UpstreamError as exc:
                log.warning("upstream_resource_resubscribe_failed", error=exc.message)

    async def _reinitialize(self, stale_session_id: str | None) -> None:
        """A 404 for a request that carried the session id means the upstream forgot the session."""
        async with self._lock:
            # Someone else may have re-initialized already (keep theirs), or forgotten the session (start one).
            if self.session_id == stale_session_id or self.initialize_result is None:
                log.info("upstream_session_expired")
                self.initialize_result = None
                await self.initialize()

    async def adopt(self, session_id: str) -> None:
        """Take over a session an earlier proxy process initialized, which holds a task the upstream still runs:
        no `initialize` (that would start another session), its GET stream opened again. Should the upstream
        have forgotten it, a request answered 404 starts a new session as usual."""
        self._stop_listening()
        self.session_id = session_id
        self.protocol_version = self.link.config.protocol_version  # tasks exist only from 2025-11-25 on
        self.initialize_result = {}  # initialized, by someone else: its InitializeResult is not known here
        self._listener = UpstreamListener(session_id, self._open_stream, self._on_stream)
        await self._listener.start(self.link.spawn, self.link.config.connect_timeout_seconds)
        log.info("upstream_session_adopted")

    def detach(self) -> None:
        """Let go of the session without ending it (no DELETE): the upstream keeps it, and the work in it, for
        the next proxy process."""
        self._stop_listening()
        self.session_id = None
        self.initialize_result = None

    async def revive(self) -> None:
        """Start a new session now (not at the next request), so listen streams keep receiving."""
        try:
            await self.ensure_initialized()
        except UpstreamError as exc:
            log.warning("upstream_session_revive_failed", error=exc.message)

    def forget(self, stale_session_id: str) -> None:
        """The upstream no longer knows this session id: the next request initializes a new session."""
        if self.session_id == stale_session_id:
            self._stop_listening()
            self.session_id = None
            self.initialize_result = None

    async def close(self) -> None:
        """End the upstream session with DELETE (the server may answer 405; that is fine); a kept session is only
        let go (`detach`)."""
        self._stop_listening()
        if self.kept:
            self.detach()
        if self.session_id is None:
            return
        with contextlib.suppress(aiohttp.ClientError, TimeoutError):
            async with self.link.http.delete(
                self.link.url, headers=self.headers(), timeout=aiohttp.ClientTimeout(total=2)
            ):
                pass
        self.session_id = None
        self.initialize_result = None

    # --- the GET stream ---------------------------------------------------------------------------------------

    async def _on_stream(self, event: StreamEvent) -> None:
        """Everything on the GET stream of a leased session is its lessee's; on a shared session nobody can tell
        whose a question is, so it is refused (an elicitation is declined). Notifications also reach listen
        subscribers (`on_notification`)."""
        if isinstance(event, SessionGone):
            # With listen streams waiting, start a new session now; otherwise the next request does. (Not from
            # the listener's task: initializing stops the old listener, i.e. cancels it.)
            self.forget(event.session_id)
            if self.subscriptions:
                self.link.spawn(self.revive(), "upstream-session-revive")
            return
        if isinstance(event, UpstreamServerRequest) and event.method == "ping":
            await self.respond(event.id, result={})
            return
        if self.lessee is not None:
            await self.lessee(event)
        elif isinstance(event, UpstreamServerRequest):
            log.info("upstream_standalone_request_refused", input_method=event.method)
            result, error = refusal(event.method, f"{event.method} outside a request {STANDALONE_REFUSED}")
            await self.respond(event.id, result=result, error=error)
        if isinstance(event, UpstreamNotification):
            self.on_notification(event)

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

    # --- requests ------------------------------------------------------------------------------------------

    async def resume(self, last_event_id: str) -> aiohttp.ClientResponse:
        """Continue a request's SSE stream the upstream closed early (GET + Last-Event-ID)."""
        headers = self.stream_headers(last_event_id)
        sent_with = self.session_id
        try:
            response = await self.link.http.get(self.link.url, headers=headers, timeout=self.link.timeout)
        except aiohttp.ClientError as exc:
            raise UpstreamError("Upstream stream could not be resumed", detail=str(exc)) from None
        content_type = response.content_type
        if response.status == 200 and content_type == "text/event-stream":
            return response
        response.release()
        if response.status == 404 and sent_with is not None:
            self.forget(sent_with)  # the session is gone: the next request initializes a new one
        raise UpstreamError(f"Upstream lost the call: resuming its stream answered HTTP {response.status}")

    @contextlib.asynccontextmanager
    async def call(
        self, method: str, params: JSON | None, extra_headers: Mapping[str, str] | None = None
    ) -> AsyncIterator[UpstreamCall]:
        """Send one request upstream; the UpstreamCall streams what comes back. Leaving the context closes it."""
        await self.ensure_initialized()
        metrics = self.link.metrics
        started = time.perf_counter()
        try:
            request_id = self.link.next_id()
            message = request_message(request_id, method, params)
            for attempt in range(2):
                sent_with = self.session_id
                try:
                    response = await self._post(message, self.headers(extra_headers))
                except asyncio.CancelledError:
                    # Abandoned while the POST was on its way: the upstream may already run it.
                    await asyncio.shield(self._cancel_unanswered(request_id))
                    raise
                if response.status == 404 and sent_with is not None and attempt == 0:
                    response.release()
                    await self._reinitialize(sent_with)
                    continue
                break
            if response.status >= 400:
                await _raise_unless_answer(response, request_id, method, self.link.max_result_bytes)
            upstream_call = UpstreamCall(self, request_id, method, response, self.link.max_result_bytes)
            self.in_flight += 1
            try:
                yield upstream_call
            finally:
                self.in_flight -= 1
                response.close()
        except UpstreamError as exc:
            if metrics is not None:
                kind = "timeout" if isinstance(exc, UpstreamTimeoutError) else "unavailable"
                metrics.upstream_errors.labels(method_label(method), kind).inc()
            raise
        finally:
            if metrics is not None:
                metrics.upstream_seconds.labels(method_label(method)).observe(time.perf_counter() - started)

    async def _cancel_unanswered(self, request_id: int) -> None:
        try:
            await self.notify("notifications/cancelled", {"requestId": request_id, "reason": "request abandoned"})
        except UpstreamError as exc:
            log.info("upstream_cancel_failed", error=exc.message)

    async def notify(self, method: str, params: JSON | None) -> None:
        response = await self._post(notification_message(method, params), self.headers())
        response.release()

    async def respond(self, request_id: RequestId, *, result: JSON | None = None, error: JSON | None = None) -> None:
        """Answer a server→client request (a JSON-RPC response POSTed with the session id)."""
        message = result_message(request_id, result or {}) if error is None else error_message(request_id, error)
        response = await self._post(message, self.headers())
        response.release()

    async def request(self, method: str, params: JSON | None) -> JSON:
        """A plain request whose stream carries nothing the caller needs: its result, or UpstreamError."""
        async with self.call(method, params) as call:
            async for event in call.events():
                if isinstance(event, UpstreamResult):
                    return event.result
                if isinstance(event, UpstreamErrorResponse):
                    raise UpstreamError(f"Upstream refused {method}: {event.error.get('message')}")
        raise UpstreamError(f"Upstream did not answer {method}")  # pragma: no cover - events() raises first

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


async def _raise_unless_answer(
    response: aiohttp.ClientResponse, request_id: int, method: str, max_bytes: int | None
) -> None:
    """An HTTP error status is fine when its body is the JSON-RPC answer to this request (some servers send
    errors that way); anything else (a transport-level refusal) is an UpstreamError naming what it said."""
    content_type = response.content_type
    if content_type == "text/event-stream":
        return
    try:
        body = await read_body(response, max_bytes)
    except EventTooLargeError:
        response.close()
        raise ResultTooLargeError(max_bytes or 0) from None
    raw = body.decode("utf-8", errors="replace")[:200]
    said = ""  # the upstream's own JSON-RPC error message, if it sent one: the client may see that
    if content_type == "application/json":
        try:
            message = json.loads(body)
        except ValueError:
            message = None
        if isinstance(message, dict):
            if message.get("id") == request_id:
                return  # the body was read, aiohttp keeps it for UpstreamCall
            error = message.get("error")
            if isinstance(error, dict) and isinstance(error.get("message"), str):
                said = f": {error['message']}"
    response.release()
    raise UpstreamRefusedError(f"Upstream answered {method} with HTTP {response.status}{said}", response.status, raw)
