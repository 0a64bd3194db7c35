"""The aiohttp application: its routes (each served through the error edge, admission first), the classification
of each request (one SERVER span, opened once classified), serving a modern request through the front and a
legacy one through the pass-through (or, for `tools/list` and `tools/call` while task handles are on,
`_legacy_handles.py`). Admission, ops (bare probes here; metrics and readiness reasons on the operations
listener) and lifecycle have modules of their own."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Final

import structlog
from aiohttp import web

from proxy.config.live import LiveConfig
from proxy.config.schema import Config
from proxy.config.warnings import start_warnings
from proxy.edge import startup
from proxy.edge._admission import read_body, refusal
from proxy.edge._app_keys import CONFIG, FRONT, JWT, LEGACY_HANDLES, LIVE, PASSTHROUGH, POOL, RELAY, RUNNER, STOPPING
from proxy.edge._drain import DRAIN, Drain, drainz
from proxy.edge._error_edge import (
    AUDIT,
    AUDITED,
    CHANNEL,
    DRAINZ,
    ERA,
    HEALTHZ,
    JSONRPC_ERROR,
    MCP_METHOD,
    METRICS,
    METRICS_PATH,
    OPS_PATHS,
    READYZ,
    RPC_ID,
    Handler,
    HttpChannel,
    error_edge,
)
from proxy.edge._jwt_identity import JwtIdentity, caller_identity
from proxy.edge._legacy_handles import NOT_READ
from proxy.edge._lifecycle import end_listen_streams, upstream_ctx
from proxy.edge._ops import healthz, metrics_moved, readyz
from proxy.edge._relay import OriginRelay
from proxy.errors import (
    InvalidRequestError,
    MethodNotAllowedError,
    ParseError,
    ProxyError,
    TaskStoreUnavailableError,
)
from proxy.observe import tracing
from proxy.observe.audit import subject
from proxy.observe.logs import logs_at
from proxy.observe.metrics import Metrics
from proxy.policy import named_tools
from proxy.tasks.store import StoreUnavailableError
from proxy.wire import jsonrpc
from proxy.wire.envelope import Caller, is_modern, may_carry_version_key, validate_modern
from proxy.wire.jsonrpc import Notification, Response

# One endpoint serves both eras: each POST is classified (docs/architecture.md), legacy traffic goes to the
# pass-through, modern requests to `Front`. A legacy POST is read as JSON only when something needs what it says (its
# method for the metrics and the request log line, its trace context, its id while draining); else it is relayed
# unread, its bytes having shown that it cannot be modern. Each request gets one SERVER span, opened in one place once
# it is classified, from its arrival. Every ProxyError raised anywhere below becomes an answer in one place, the error
# edge (`_error_edge.py`). What is refused before classification is `_admission.py`'s; the operators' endpoints are
# `_ops.py`'s; what opens and closes with the app is `_lifecycle.py`'s.

log = structlog.get_logger(__name__)


Serve = Callable[[tracing.ServerSpan], Awaitable[web.StreamResponse]]  # what serves a classified request


def admitted(request: web.Request, handler: Handler) -> Awaitable[web.StreamResponse]:
    """The error edge's gate (`_error_edge.py`): the admission rules (`_admission.py`) before anything is read (the
    operators' endpoints are exempt), then the route's handler. A refusal is raised here, for the error edge to
    answer. Returns the awaitable of the answer: no frame of its own."""
    if request.method != "GET" or request.path not in OPS_PATHS:
        refused = refusal(request, request.app[LIVE].current.security)
        if refused is not None:
            if tracing.enabled():  # refused before anything was read: its SERVER span names the error
                return _in_server_span(request, None, _era_of_headers(request), None, _raising(refused))
            raise refused
    return handler(request)


def unrouted(own: Mapping[str, tuple[str, ...]]) -> Handler:
    """The last route, for every path and method no other route serves: a path of the proxy's own served with
    another method gets 405 (`own`: its methods), one of the operators' paths that is not served 404 (e.g.
    /metrics switched off: still the proxy's, never relayed); any other goes to the upstream's origin
    (`_relay.py`)."""

    def relay_unrouted(request: web.Request) -> Awaitable[web.StreamResponse]:
        allowed = own.get(request.path)
        if allowed is not None:
            raise web.HTTPMethodNotAllowed(request.method, allowed)
        relay = request.app.get(RELAY)
        if relay is None or request.path in OPS_PATHS:
            raise web.HTTPNotFound()
        return _relay_unrouted(request, relay)

    return relay_unrouted


def _relay_unrouted(request: web.Request, relay: OriginRelay) -> Awaitable[web.StreamResponse]:
    request[ERA] = "relayed"
    arrived = time.time_ns() if tracing.enabled() else None

    async def to_origin(span: tracing.ServerSpan) -> web.StreamResponse:
        body = await read_body(request, request.app[LIVE].current.security) if request.body_exists else None
        response = await relay.relay(request, body)
        span.status(response.status)
        return response

    return _in_server_span(request, None, "relayed", arrived, to_origin)


# --- the MCP endpoint ---------------------------------------------------------------------------------


async def handle_mcp(request: web.Request) -> web.StreamResponse:
    """Every request gets its SERVER span, from its arrival here (its body read included), refused ones too:
    the request is classified first, then served in the span named after what it turned out to be. While it is
    served it is in flight for a drain."""
    app = request.app
    drain = app[DRAIN]
    drain.serving(request)
    try:
        arrived = time.time_ns() if tracing.enabled() else None
        era, decoded, serve = await _classify(request, app)
        return await _in_server_span(request, decoded, era, arrived, serve)
    finally:
        drain.served(request)


async def _classify(request: web.Request, app: web.Application) -> tuple[str, object, Serve]:
    """The request's era, its JSON-RPC message when one was read, and what serves it; a refusal found while
    classifying is served by raising it (in the SERVER span, as every answer)."""
    if request.method != "POST":
        if request.method in ("GET", "DELETE") and is_modern(request.headers, None):
            # A modern client has no GET stream and no session to delete.
            request[ERA] = "modern"
            return "modern", None, _raising(MethodNotAllowedError())
        request[ERA] = "legacy"
        return "legacy", None, _relayed(request, app, None)
    try:
        body = await read_body(request, app[LIVE].current.security)
    except ProxyError as error:  # too large, or not in time: the era as the headers tell it
        return _era_of_headers(request), None, _raising(error)
    modern_header = is_modern(request.headers, None)
    if not modern_header and not may_carry_version_key(body):
        return _legacy_post(request, app, body, None, decoded=False)  # legacy by its bytes: not decoded
    try:
        decoded = jsonrpc.loads(body)
    except ParseError as error:
        if modern_header:
            request[ERA] = "modern"
            return "modern", None, _raising(error)
        return _legacy_post(request, app, body, None, decoded=True)
    if not is_modern(request.headers, decoded):
        return _legacy_post(request, app, body, decoded, decoded=True)
    request[ERA] = "modern"

    def modern(span: tracing.ServerSpan) -> Awaitable[web.StreamResponse]:
        return serve_modern(request, decoded)

    return "modern", decoded, modern


def _in_server_span(
    request: web.Request, decoded: object, era: str, arrived: int | None, serve: Serve
) -> Awaitable[web.StreamResponse]:
    """The one place a request's SERVER span is opened: from its arrival (`arrived`, epoch ns), named after
    what classifying found (its era, its message). With tracing off, `serve` with no span and no frame."""
    if not tracing.enabled():
        return serve(tracing.NO_SPAN)
    return _spanned(request, decoded, era, arrived, serve)


async def _spanned(
    request: web.Request, decoded: object, era: str, arrived: int | None, serve: Serve
) -> web.StreamResponse:
    with tracing.server_span(
        request.headers, decoded, era=era, http_method=request.method, peer=request.remote, start_time=arrived
    ) as span:
        return await serve(span)


def _era_of_headers(request: web.Request) -> str:
    """The era as the headers alone tell it, for a request refused before its body was read."""
    return "modern" if is_modern(request.headers, None) else "legacy"


def _raising(error: ProxyError) -> Serve:
    """Serves a refusal: raises it, for the error edge to answer."""

    async def serve(span: tracing.ServerSpan) -> web.StreamResponse:
        raise error

    return serve


def _reads_legacy_messages(app: web.Application) -> bool:
    """Whether anything needs what a legacy POST says (its method, id or trace context): the request metrics,
    the request log line, tracing, or a drain (which refuses a new session with the request's id)."""
    # (`get`, not `in`: an absent key's `in` raises and catches a KeyError)
    return app.get(METRICS) is not None or logs_at(logging.INFO) or tracing.enabled() or app[DRAIN].draining


def _legacy_post(
    request: web.Request, app: web.Application, body: bytes, message: object, *, decoded: bool
) -> tuple[str, object, Serve]:
    """A legacy client's POST, relayed as it came. Its body is read as JSON only when something needs what it
    says (`_reads_legacy_messages`); `decoded` tells whether `message` is that reading already (None for a body
    that is not JSON). A drain refuses a new session here, before the SERVER span."""
    request[ERA] = "legacy"
    if not decoded and _reads_legacy_messages(app):
        decoded = True
        try:
            message = jsonrpc.loads(body)
        except ParseError:
            message = None  # relayed all the same: the upstream answers it
    if isinstance(message, dict) and isinstance(message.get("method"), str):
        request[MCP_METHOD] = message["method"]
    app[DRAIN].check_legacy(request, message)
    config = app[LIVE].current  # once for this request
    if config.tasks.has_handles:  # the handles read tools/list and tools/call
        served = app[LEGACY_HANDLES].serve(request, body, message if decoded else NOT_READ, config)
        if served is not None:
            return "legacy", message, served
    return "legacy", message, _relayed(request, app, body, message)


def _relayed(request: web.Request, app: web.Application, body: bytes | None, message: object = None) -> Serve:
    """A legacy client's request, relayed by the pass-through; the relayed status is the span's outcome. Where the
    proxy makes the upstream credential (`upstream.credentials`), the caller is verified first, as a modern one."""
    if not app[POOL].kind.credentials.forwards:
        return _relayed_for_caller(request, app, body, message)

    def relay(span: tracing.ServerSpan) -> Awaitable[web.StreamResponse]:
        relayed = app[PASSTHROUGH].relay(request, body)
        return relayed if span is tracing.NO_SPAN else _with_status(span, relayed)

    return relay


async def _with_status(span: tracing.ServerSpan, relayed: Awaitable[web.StreamResponse]) -> web.StreamResponse:
    response = await relayed
    span.status(response.status)
    return response


def _called_tool(message: object) -> str | None:
    """The tool a legacy `tools/call` message calls (None for another message, or one not read)."""
    if isinstance(message, dict) and message.get("method") == "tools/call":
        params = message.get("params")
        name = params.get("name") if isinstance(params, dict) else None
        return name if isinstance(name, str) else None
    return None


def _relayed_for_caller(request: web.Request, app: web.Application, body: bytes | None, message: object) -> Serve:
    """Relayed with the upstream credential the proxy makes for the verified caller (and the tool it calls, when
    known), never the caller's own header."""

    async def relay(span: tracing.ServerSpan) -> web.StreamResponse:
        identity = await caller_identity(request.headers, app[LIVE].current, app.get(JWT))
        response = await app[PASSTHROUGH].relay(request, body, identity=identity, tool=_called_tool(message))
        span.status(response.status)
        return response

    return relay


async def serve_modern(request: web.Request, decoded: object) -> web.StreamResponse:
    message = jsonrpc.classify(decoded)
    if isinstance(message, Notification):
        request[MCP_METHOD] = message.method
        return web.Response(status=202)  # a notification is accepted with no body
    if message.id is not None:
        request[RPC_ID] = message.id  # from here on, every error answer echoes it
    if isinstance(message, Response):
        raise InvalidRequestError("Invalid Request: a 2026-07-28 server sends no requests, so it takes no responses")
    request[MCP_METHOD] = message.method
    app = request.app
    audited = _audited(request, message.method, message.params) if app.get(AUDIT) is not None else None
    modern = validate_modern(request.headers, message.id, message.method, message.params)
    app[DRAIN].check_modern(modern)
    config = app[LIVE].current
    principal = await caller_identity(request.headers, config, app.get(JWT))
    caller = Caller(principal=principal, headers=request.headers)
    if audited is not None:
        audited.update(subject=subject(principal), principal=app[RUNNER].tasks.owner_of(principal) or None)
    channel = request[CHANNEL] = HttpChannel(request, config.limits.write_timeout_seconds)
    try:
        reply = await app[FRONT].dispatch(modern, caller, channel)
    except StoreUnavailableError as exc:  # the store is away for now: 503 + Retry-After, never a hang or a 500
        raise TaskStoreUnavailableError(exc.kind, exc.reason, detail=str(exc)) from exc
    request[JSONRPC_ERROR] = "error" in reply
    if audited is not None:
        _audit_outcome(audited, reply)
    tracing.reply_outcome(reply)
    return await channel.finish(reply)


_AUDITED_NAME_CHARS: Final = 256  # of a tool name or resource URI in an audit line


def _audited(request: web.Request, method: str, params: object) -> dict[str, object]:
    """What the audit line of a modern request names: its tool (prompt, resource) or task. Never an argument."""
    audited: dict[str, object] = {}
    request[AUDITED] = audited
    if isinstance(params, dict):
        for key, field in (("name", "tool"), ("uri", "tool"), ("taskId", "task_id")):
            value = params.get(key)
            if isinstance(value, str):
                audited[field] = value[:_AUDITED_NAME_CHARS]
    return audited


def _audit_outcome(audited: dict[str, object], reply: Mapping[str, object]) -> None:
    """The reply's outcome: its `resultType` (complete, task, input_required), or `error` with its code."""
    error, result = reply.get("error"), reply.get("result")
    if isinstance(error, dict):
        audited.update(outcome="error", code=error.get("code"))
    elif isinstance(result, dict):
        audited["outcome"] = result.get("resultType", "complete")
        if result.get("resultType") == "task" and isinstance(result.get("taskId"), str):
            audited["task_id"] = result["taskId"]


def create_app(config: Config, live: LiveConfig | None = None) -> web.Application:
    """The app for `config`; `live` is the holder reloads swap (a fresh one, with no file, when not given)."""
    live = live if live is not None else LiveConfig(config)
    drain = Drain(live, config.listen.path)
    startup.warn(start_warnings(config))  # what `check-config` prints too
    app = web.Application(client_max_size=config.security.max_body_bytes)
    app[CONFIG] = config
    app[LIVE] = live
    app[DRAIN] = drain
    app[STOPPING] = []
    app.cleanup_ctx.append(upstream_ctx)
    if config.security.jwt is not None:
        identity = app[JWT] = JwtIdentity(config.security.jwt)

        async def close_identity(app: web.Application) -> None:
            await identity.close()

        app.on_cleanup.append(close_identity)
    app.on_shutdown.append(end_listen_streams)
    edge = error_edge(admitted)  # every route is served through the error edge
    app.router.add_route("*", config.listen.path, edge(handle_mcp))
    # /metrics is served by the operations listener (`ops_app`), never here: its answer says where it went
    ops: dict[str, Handler] = {HEALTHZ: healthz, READYZ: readyz, DRAINZ: drainz, METRICS_PATH: metrics_moved}
    if config.observability.metrics and config.observability.port is not None:
        metrics = app[METRICS] = Metrics(named_tools(config.tasks))
        drain.register_metrics(metrics.registry)
        live.register_metrics(metrics.registry)
    for path, handler in ops.items():
        app.router.add_get(path, edge(handler))
    app.router.add_route("*", "/{path:.*}", edge(unrouted({path: ("GET", "HEAD") for path in ops})))  # last
    return app
