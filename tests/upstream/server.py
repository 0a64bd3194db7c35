"""Assembly of the legacy fixture upstream: a FastMCP (mcp 1.x) server with every fixture registered,
the protocol handlers FastMCP lacks (logging/setLevel, resources/(un)subscribe, completion/complete),
an in-memory SSE event store (resumability / SEP-1699 polling), loopback DNS-rebinding protection,
and the two deliberate departures from stock FastMCP: McpError raised by a tool becomes a JSON-RPC
error, and an unknown resource URI answers -32002 instead of the SDK's code 0.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import anyio
from mcp import types
from mcp.server.fastmcp import FastMCP
from mcp.server.fastmcp.exceptions import ToolError
from mcp.server.lowlevel import Server
from mcp.server.lowlevel.helper_types import ReadResourceContents
from mcp.server.lowlevel.server import NotificationOptions
from mcp.server.streamable_http import EventCallback, EventId, EventMessage, EventStore, StreamId
from mcp.server.transport_security import TransportSecuritySettings
from mcp.shared.exceptions import McpError
from pydantic import AnyUrl
from starlette.applications import Starlette
from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tests.upstream import (
    auth_fixtures,
    conformance_fixtures,
    core_fixtures,
    handle_fixtures,
    job_fixtures,
    legacy_task_fixtures,
    project_fixtures,
    support,
    task_fixtures,
)

SERVER_NAME = "legacy-fixture-upstream"
RESOURCE_NOT_FOUND = -32002
DEFAULT_RETRY_INTERVAL_MS = 1000
_EVENT_STORE_LIMIT = 20_000

_LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "[::1]")

_escalated_errors: ContextVar[list[McpError] | None] = ContextVar("_escalated_errors", default=None)


class _FixtureLowLevelServer(Server[Any, Any]):
    """Low-level server that also advertises what the fixture implements beyond FastMCP's defaults."""

    def get_capabilities(
        self,
        notification_options: NotificationOptions,
        experimental_capabilities: dict[str, dict[str, Any]],
    ) -> types.ServerCapabilities:
        caps = super().get_capabilities(notification_options, experimental_capabilities)
        if caps.resources is not None:
            caps.resources.subscribe = types.SubscribeRequest in self.request_handlers
            caps.resources.listChanged = True
        if caps.tools is not None:
            caps.tools.listChanged = True
        if caps.prompts is not None:
            caps.prompts.listChanged = True
        return caps


class FixtureMCP(FastMCP[Any]):
    """FastMCP whose tool-raised McpError surfaces as a JSON-RPC error and whose unknown resources
    answer -32002 (stock FastMCP turns both into an isError result / error code 0)."""

    async def call_tool(self, name: str, arguments: dict[str, Any]) -> Sequence[types.ContentBlock] | dict[str, Any]:
        try:
            return await super().call_tool(name, arguments)
        except ToolError as exc:
            slot = _escalated_errors.get()
            if isinstance(exc.__cause__, McpError) and slot is not None:
                slot.append(exc.__cause__)
            raise

    async def read_resource(self, uri: AnyUrl | str) -> list[ReadResourceContents]:
        try:
            await self._resource_manager.get_resource(uri, context=self.get_context())
        except ValueError:
            raise McpError(
                types.ErrorData(code=RESOURCE_NOT_FOUND, message="Resource not found", data={"uri": str(uri)})
            ) from None
        return list(await super().read_resource(uri))

    def streamable_http_app(self) -> Starlette:
        app = super().streamable_http_app()
        app.add_middleware(_SessionScopeMiddleware)
        return app


@dataclass
class _SessionBox:
    """Which MCP session the current HTTP request (or the session task it spawned) belongs to."""

    session_id: str | None


_current_session: ContextVar[_SessionBox | None] = ContextVar("_current_session", default=None)


class _SessionScopeMiddleware:
    """Pure ASGI middleware tagging each request's context with its MCP session id.

    The SDK shares one EventStore between all sessions and uses the JSON-RPC request id as stream
    id, so two sessions both sending id 1 would share stream "1". The session's server task is
    started from (and inherits the context of) the opening initialize request, whose box is filled
    from the ``mcp-session-id`` response header - so events stored by that task are scoped too.
    """

    def __init__(self, app: ASGIApp) -> None:
        self._app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        header = Headers(scope=scope).get("mcp-session-id")
        box = _SessionBox(header)
        token = _current_session.set(box)

        async def tagging_send(message: Message) -> None:
            if box.session_id is None and message["type"] == "http.response.start":
                box.session_id = MutableHeaders(raw=list(message.get("headers", []))).get("mcp-session-id")
            await send(message)

        try:
            await self._app(scope, receive, tagging_send)
        finally:
            _current_session.reset(token)


@dataclass
class _StoredEvent:
    seq: int
    session_id: str | None
    stream_id: StreamId
    message: types.JSONRPCMessage | None


class InMemoryEventStore(EventStore):
    """Bounded in-memory event store scoped per session (see ``_SessionScopeMiddleware``).

    Event ids are ``<stream>/<seq>`` with one global sequence. A replay returns the later events of
    the same session's same stream, up to the next priming event of that stream (a reused id).
    """

    def __init__(self, limit: int = _EVENT_STORE_LIMIT) -> None:
        self._events: dict[EventId, _StoredEvent] = {}
        self._seq = itertools.count(1)
        self._limit = limit

    async def store_event(self, stream_id: StreamId, message: types.JSONRPCMessage | None) -> EventId:
        seq = next(self._seq)
        box = _current_session.get()
        event_id = f"{stream_id}/{seq}"
        self._events[event_id] = _StoredEvent(seq, box.session_id if box else None, stream_id, message)
        while len(self._events) > self._limit:
            del self._events[next(iter(self._events))]
        return event_id

    async def replay_events_after(self, last_event_id: EventId, send_callback: EventCallback) -> StreamId | None:
        last = self._events.get(last_event_id)
        if last is None:
            return None
        box = _current_session.get()
        if box is not None and box.session_id is not None and last.session_id not in (None, box.session_id):
            return None  # another session's event id
        for event_id, event in list(self._events.items()):
            if event.seq <= last.seq or event.stream_id != last.stream_id or event.session_id != last.session_id:
                continue
            if event.message is None:
                break  # priming event of a newer stream reusing the same request id
            await send_callback(EventMessage(event.message, event_id))
        return last.stream_id


def _security(host: str) -> TransportSecuritySettings:
    hosts = list(_LOOPBACK_HOSTS)
    bare = host.strip("[]")
    if bare not in ("127.0.0.1", "localhost", "::1", "0.0.0.0", "::", ""):
        hosts.append(f"[{bare}]" if ":" in bare else bare)
    return TransportSecuritySettings(
        enable_dns_rebinding_protection=True,
        allowed_hosts=[f"{h}:*" for h in hosts],
        allowed_origins=[f"http://{h}:*" for h in hosts],
    )


def _install_protocol_handlers(low: Server[Any, Any]) -> None:
    """Handlers FastMCP does not register, plus the tools/call wrapper (JSON-RPC errors, cancellations)."""

    async def set_level(req: types.SetLevelRequest) -> types.ServerResult:
        support.set_log_level(low.request_context.session, req.params.level)
        return types.ServerResult(types.EmptyResult())

    async def subscribe(req: types.SubscribeRequest) -> types.ServerResult:
        support.subscribe(low.request_context.session, str(req.params.uri))
        return types.ServerResult(types.EmptyResult())

    async def unsubscribe(req: types.UnsubscribeRequest) -> types.ServerResult:
        support.unsubscribe(low.request_context.session, str(req.params.uri))
        return types.ServerResult(types.EmptyResult())

    async def complete(req: types.CompleteRequest) -> types.ServerResult:
        values = conformance_fixtures.completions(req.params.ref, req.params.argument.name)
        prefix = req.params.argument.value
        matching = [v for v in values if v.startswith(prefix)]
        return types.ServerResult(
            types.CompleteResult(completion=types.Completion(values=matching, total=len(matching), hasMore=False))
        )

    inner_call_tool = low.request_handlers[types.CallToolRequest]

    async def call_tool(req: types.CallToolRequest) -> types.ServerResult:
        slot: list[McpError] = []
        token = _escalated_errors.set(slot)
        try:
            result = await inner_call_tool(req)
        except anyio.get_cancelled_exc_class():
            ctx = low.request_context
            # The SDK cancels the handler both for notifications/cancelled and for session teardown;
            # only the former marks the request's responder as cancelled.
            responder = ctx.session._in_flight.get(ctx.request_id)
            if responder is not None and responder.cancelled:
                support.record_cancelled(ctx.request_id)
            raise
        finally:
            _escalated_errors.reset(token)
        if slot:
            raise slot[0]
        return result

    low.request_handlers[types.SetLevelRequest] = set_level
    low.request_handlers[types.SubscribeRequest] = subscribe
    low.request_handlers[types.UnsubscribeRequest] = unsubscribe
    low.request_handlers[types.CompleteRequest] = complete
    low.request_handlers[types.CallToolRequest] = call_tool


def build_server(
    *,
    host: str = "127.0.0.1",
    stateless: bool = False,
    json_response: bool = False,
    retry_interval_ms: int | None = DEFAULT_RETRY_INTERVAL_MS,
    resumable: bool = True,
    legacy_tasks: bool = False,
    auth: tuple[str, str, str] | None = None,
) -> FixtureMCP:
    """The fully registered fixture server (not yet bound to any transport); ``legacy_tasks`` adds the
    tools the server runs as its own 2025-11-25 tasks (see legacy_task_fixtures.py); ``auth`` (a JWKS file,
    the issuer, the resource URL) makes it an OAuth resource server (see auth_fixtures.py)."""
    resource_server: dict[str, Any] = {}
    if auth is not None:
        jwks, issuer, resource_url = auth
        resource_server = auth_fixtures.settings(issuer, resource_url)
        resource_server["token_verifier"] = auth_fixtures.JwksTokenVerifier(jwks, issuer)
    mcp = FixtureMCP(
        SERVER_NAME,
        instructions="Legacy (2025-11-25) fixture upstream for mcp-tasks-proxy tests and conformance runs.",
        event_store=InMemoryEventStore() if resumable and not stateless else None,
        retry_interval=retry_interval_ms,
        host=host,
        json_response=json_response,
        stateless_http=stateless,
        log_level="WARNING",
        transport_security=_security(host),
        **resource_server,
    )
    # Advertise subscribe/listChanged: swap in a subclass that only overrides get_capabilities.
    mcp._mcp_server.__class__ = _FixtureLowLevelServer
    conformance_fixtures.register(mcp)
    core_fixtures.register(mcp)
    task_fixtures.register(mcp)
    project_fixtures.register(mcp)
    job_fixtures.register(mcp)
    handle_fixtures.register(mcp)
    _install_protocol_handlers(mcp._mcp_server)
    if legacy_tasks:
        legacy_task_fixtures.enable(mcp)
    if auth is not None:
        auth_fixtures.register_echo(mcp)
        auth_fixtures.register_credential_tools(mcp)
        auth_fixtures.register_scoped_tool(mcp)
    return mcp


def build_app(
    *,
    host: str = "127.0.0.1",
    stateless: bool = False,
    json_response: bool = False,
    retry_interval_ms: int | None = DEFAULT_RETRY_INTERVAL_MS,
    resumable: bool = True,
    legacy_tasks: bool = False,
    auth: tuple[str, str, str] | None = None,
) -> Starlette:
    """ASGI app serving the fixture at ``/mcp`` (its lifespan runs the SDK session manager)."""
    return build_server(
        auth=auth,
        host=host,
        stateless=stateless,
        json_response=json_response,
        retry_interval_ms=retry_interval_ms,
        resumable=resumable,
        legacy_tasks=legacy_tasks,
    ).streamable_http_app()
