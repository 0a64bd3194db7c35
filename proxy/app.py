"""The aiohttp application: routes, middlewares, THE error edge, lifecycle.

One endpoint serves both eras: each POST is classified (architecture.md), legacy traffic goes to the
pass-through, modern requests to `Front`. Every ProxyError raised anywhere below becomes a JSON-RPC error
body and HTTP status here, in `error_edge`, and nowhere else.
"""

from __future__ import annotations

import itertools
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Final

import aiohttp
import structlog
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST
from yarl import URL

from proxy.config import Config
from proxy.errors import (
    ForbiddenError,
    InvalidRequestError,
    MethodNotAllowedError,
    MethodNotFoundError,
    ParseError,
    PayloadTooLargeError,
    ProxyError,
    UpstreamError,
)
from proxy.front import Front
from proxy.observability import Metrics, method_label
from proxy.policy import named_tools
from proxy.tasks.runner import TaskRunner
from proxy.tasks.store import SqliteTaskStore, StoreError
from proxy.upstream.kinds import SessionKind
from proxy.upstream.passthrough import LegacyRelay, PassThrough
from proxy.upstream.pool import UpstreamClient
from proxy.upstream.session import UpstreamLink
from proxy.upstream.sse import KEEPALIVE, frame
from proxy.upstream.stdio_legacy import StdioLegacyServer
from proxy.upstream.stdio_link import StdioLink
from proxy.wire import jsonrpc
from proxy.wire.envelope import Caller, is_modern, validate_modern
from proxy.wire.jsonrpc import JSON, Notification, Response

log = structlog.get_logger(__name__)

CONFIG: Final = web.AppKey("config", Config)
FRONT: Final = web.AppKey("front", Front)
PASSTHROUGH: Final = web.AppKey("passthrough", LegacyRelay)
UPSTREAM: Final = web.AppKey("upstream", UpstreamClient)
STORE: Final = web.AppKey("store", SqliteTaskStore)
RUNNER: Final = web.AppKey("runner", TaskRunner)
METRICS: Final = web.AppKey("metrics", Metrics)
STOPPING: Final = web.AppKey("stopping", list[bool])
ERA: Final = web.RequestKey("era", str)
MCP_METHOD: Final = web.RequestKey("mcp_method", str)
JSONRPC_ERROR: Final = web.RequestKey("jsonrpc_error", bool)

# Probes and scrapes come from kubelet and Prometheus with the pod IP as Host: these GETs skip the Host/Origin
# allow-list (they carry no MCP traffic and reveal no tokens or arguments). Everything else is checked.
HEALTHZ: Final = "/healthz"
READYZ: Final = "/readyz"
METRICS_PATH: Final = "/metrics"
OPS_PATHS: Final = frozenset({HEALTHZ, READYZ, METRICS_PATH})

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# The `request_id` of log lines: unique per process (counter) and across processes (random prefix).
REQUEST_ID_PREFIX: Final = secrets.token_hex(4) + "-"
_request_numbers = itertools.count(1)


# --- the error edge ------------------------------------------------------------------------------------


def error_response(error: ProxyError) -> web.Response:
    return web.json_response(
        jsonrpc.error_message(error.request_id, error.error_object()),
        status=error.status,
        headers=error.headers,
        dumps=lambda obj: jsonrpc.dumps(obj).decode(),
    )


@web.middleware
async def error_edge(request: web.Request, handler: Handler) -> web.StreamResponse:
    """The one place where failures become HTTP responses; also the one request log line."""
    request_id = f"{REQUEST_ID_PREFIX}{next(_request_numbers):x}"
    structlog.contextvars.bind_contextvars(request_id=request_id)
    started = time.perf_counter()
    status = 500
    try:
        response = await handler(request)
        status = response.status
        return response
    except ProxyError as error:
        status = error.status
        log.info("request_rejected", code=error.code, reason=error.message)
        return error_response(error)
    except web.HTTPException as exc:
        status = exc.status
        raise
    except ConnectionResetError:
        status = 499  # the client closed the connection before its answer was written (nginx's convention)
        log.info("client_disconnected")
        return web.Response(status=status)
    except Exception:
        log.exception("request_failed")
        status = 500
        return error_response(ProxyError("Internal error"))
    finally:
        duration = time.perf_counter() - started
        fields = {
            "http_method": request.method,
            "path": request.path,
            "era": request.get(ERA, "-"),
            "mcp_method": request.get(MCP_METHOD, "-"),
            "status": status,
            "duration_ms": round(duration * 1000, 2),
        }
        if request.path in OPS_PATHS:
            log.debug("request", **fields)  # a probe every few seconds would drown the useful lines
        else:
            log.info("request", **fields)
            _count(request, status, duration)
        structlog.contextvars.unbind_contextvars("request_id")


def _count(request: web.Request, status: int, duration_seconds: float) -> None:
    metrics = request.app.get(METRICS)
    if metrics is None:
        return
    era = request.get(ERA, "-")
    method = method_label(request.get(MCP_METHOD))
    if status == 499:
        outcome = "disconnected"
    elif status >= 500:
        outcome = "server_error"
    elif status >= 400:
        outcome = "client_error"
    elif request.get(JSONRPC_ERROR, False):
        outcome = "jsonrpc_error"
    else:
        outcome = "ok"
    metrics.requests.labels(era, method, outcome).inc()
    metrics.request_seconds.labels(era, method).observe(duration_seconds)


# --- admission: Host / Origin (DNS-rebinding protection, C-28) ----------------------------------------


def _host_name(host: str) -> str:
    host = host.strip().lower()
    if host.startswith("["):
        end = host.find("]")
        return host[: end + 1] if end > 0 else host
    name, _, _ = host.partition(":")
    return name


def host_allowed(host: str | None, allowed_hosts: list[str]) -> bool:
    return host is not None and _host_name(host) in {name.lower() for name in allowed_hosts}


def origin_allowed(origin: str, allowed_hosts: list[str], allowed_origins: list[str]) -> bool:
    if origin in allowed_origins:
        return True
    url = URL(origin)
    if url.scheme not in ("http", "https") or url.raw_host is None:
        return False
    host = url.raw_host.lower()
    if ":" in host:  # IPv6 literal
        host = f"[{host}]"
    return host in {name.lower() for name in allowed_hosts}


@web.middleware
async def admission(request: web.Request, handler: Handler) -> web.StreamResponse:
    if request.method == "GET" and request.path in OPS_PATHS:
        return await handler(request)
    security = request.app[CONFIG].security
    if not host_allowed(request.headers.get("Host"), security.allowed_hosts):
        raise ForbiddenError("Forbidden: Host header not allowed")
    origin = request.headers.get("Origin")
    if origin is not None and not origin_allowed(origin, security.allowed_hosts, security.allowed_origins):
        raise ForbiddenError("Forbidden: Origin not allowed")
    return await handler(request)


# --- the MCP endpoint ---------------------------------------------------------------------------------


class HttpChannel:
    """Notifications before the final message: the response turns into an SSE stream at the first one."""

    def __init__(self, request: web.Request) -> None:
        self.request = request
        self.sse_allowed = "text/event-stream" in request.headers.get("Accept", "")
        self.stream: web.StreamResponse | None = None

    async def notify(self, message: JSON, *, required: bool = False) -> None:
        if not (self.sse_allowed or required):
            return
        stream = await self._open()
        await stream.write(frame(jsonrpc.dumps(message).decode()))

    async def keepalive(self, *, open_stream: bool = False) -> None:
        if self.stream is None and open_stream and self.sse_allowed:
            await self._open()
        if self.stream is not None:
            await self.stream.write(KEEPALIVE)

    async def _open(self) -> web.StreamResponse:
        if self.stream is None:
            self.stream = web.StreamResponse(
                status=200,
                headers={
                    "Content-Type": "text/event-stream",
                    "Cache-Control": "no-cache",
                    "X-Accel-Buffering": "no",  # C-21
                },
            )
            await self.stream.prepare(self.request)
        return self.stream

    async def finish(self, message: JSON) -> web.StreamResponse:
        if self.stream is None:
            return web.json_response(message, status=_status_of(message), dumps=lambda obj: jsonrpc.dumps(obj).decode())
        await self.stream.write(frame(jsonrpc.dumps(message).decode()))
        await self.stream.write_eof()
        return self.stream


def _status_of(message: JSON) -> int:
    """HTTP status of a final message the front built: results and relayed upstream errors are 200 (Q8),
    except -32601, which is 404 (C-27): a method the upstream does not implement, the proxy does not either."""
    error = message.get("error")
    if isinstance(error, dict) and error.get("code") == MethodNotFoundError.code:
        return MethodNotFoundError.http_status
    return 200


async def _read_body(request: web.Request) -> bytes:
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise PayloadTooLargeError(
            f"Request body too large (limit {request.app[CONFIG].security.max_body_bytes} bytes)"
        ) from None


async def handle_mcp(request: web.Request) -> web.StreamResponse:
    if request.method != "POST":
        if request.method in ("GET", "DELETE") and is_modern(request.headers, None):
            # C-22: a modern client has no GET stream and no session to delete.
            request[ERA] = "modern"
            raise MethodNotAllowedError()
        request[ERA] = "legacy"
        return await request.app[PASSTHROUGH].relay(request, None)
    body = await _read_body(request)
    try:
        decoded = jsonrpc.loads(body)
    except ParseError:
        if is_modern(request.headers, None):
            request[ERA] = "modern"
            raise
        request[ERA] = "legacy"
        return await request.app[PASSTHROUGH].relay(request, body)
    if not is_modern(request.headers, decoded):
        request[ERA] = "legacy"
        if isinstance(decoded, dict) and isinstance(decoded.get("method"), str):
            request[MCP_METHOD] = decoded["method"]
        return await request.app[PASSTHROUGH].relay(request, body)
    request[ERA] = "modern"
    return await serve_modern(request, decoded)


async def serve_modern(request: web.Request, decoded: object) -> web.StreamResponse:
    message = jsonrpc.classify(decoded)
    if isinstance(message, Notification):
        request[MCP_METHOD] = message.method
        return web.Response(status=202)  # C-20: accepted, no body.
    if isinstance(message, Response):
        raise InvalidRequestError(
            "Invalid Request: a 2026-07-28 server sends no requests, so it takes no responses",
            request_id=message.id,
        )
    request[MCP_METHOD] = message.method
    modern = validate_modern(request.headers, message.id, message.method, message.params)
    config = request.app[CONFIG]
    caller = Caller(
        principal=request.headers.get(config.security.principal_header),
        headers=request.headers,
    )
    channel = HttpChannel(request)
    try:
        reply = await request.app[FRONT].dispatch(modern, caller, channel)
    except ProxyError as error:
        if error.request_id is None:
            error.request_id = modern.id  # every error echoes the request id
        if channel.stream is None:
            raise
        # The stream is already open (notifications went out): the error is its last event.
        reply = jsonrpc.error_message(error.request_id, error.error_object())
    request[JSONRPC_ERROR] = "error" in reply
    return await channel.finish(reply)


# --- lifecycle ---------------------------------------------------------------------------------------


def upstream_kind(config: Config, http: aiohttp.ClientSession, metrics: Metrics | None) -> SessionKind:
    """Stdio server processes the proxy runs when `upstream.command` is set, else Streamable HTTP sessions."""
    if config.upstream.command:
        return StdioLink(config.upstream, metrics)
    return UpstreamLink(config.upstream, http, config.security.principal_header, metrics)


async def upstream_ctx(app: web.Application) -> AsyncIterator[None]:
    config = app[CONFIG]
    # The store first: a database in use by another process stops the start before anything else is opened.
    store = await SqliteTaskStore.open(
        config.store.path, max_records=config.tasks.max_records, synchronous=config.store.synchronous
    )
    app[STORE] = store
    connector = aiohttp.TCPConnector(limit=0)
    http = aiohttp.ClientSession(connector=connector, auto_decompress=True)
    relay_http = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), auto_decompress=False, skip_auto_headers=("User-Agent",)
    )
    metrics = app.get(METRICS)
    upstream = UpstreamClient(upstream_kind(config, http, metrics))
    app[UPSTREAM] = upstream
    runner = TaskRunner(config, store, upstream, metrics=metrics)
    app[RUNNER] = runner
    if metrics is not None:
        metrics.tasks_running.set_function(lambda: runner.running)
        metrics.calls_parked.set_function(lambda: runner.parked)
    app[FRONT] = Front(config, upstream, runner)
    legacy: StdioLegacyServer | None = None
    if isinstance(upstream.kind, StdioLink):  # a stdio server: the proxy serves legacy clients itself
        legacy = StdioLegacyServer(upstream.kind, upstream, config.upstream, config.security.principal_header)
        app[PASSTHROUGH] = legacy
    else:
        app[PASSTHROUGH] = PassThrough(
            config.upstream.url,
            relay_http,
            config.upstream.headers,
            config.upstream.connect_timeout_seconds,
            config.upstream.call_timeout_seconds,
        )
    try:
        await runner.start()  # restart recovery happens before the first request is served
        upstream.warm_up()
        yield
    finally:
        await runner.close()
        await store.close()
        if legacy is not None:
            await legacy.close()
        await upstream.close()
        await http.close()
        await relay_http.close()


async def end_listen_streams(app: web.Application) -> None:
    """on_shutdown runs before aiohttp waits for handlers: listen streams end with their graceful result, and
    readiness turns 503 so no new traffic is routed here while synchronous calls finish."""
    app[STOPPING].append(True)
    if UPSTREAM in app:
        app[UPSTREAM].end_subscriptions()


# --- health and metrics --------------------------------------------------------------------------------


async def healthz(request: web.Request) -> web.Response:
    """Liveness: the process serves HTTP."""
    return web.json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    """Readiness: the task store takes a committed write and the upstream answered recently (else a fresh
    `initialize` must succeed). 503 with the reasons otherwise."""
    app = request.app
    reasons: list[str] = []
    if app[STOPPING]:
        reasons.append("shutting down")
    else:
        try:
            await app[STORE].check_writable(app[RUNNER].clock())
        except StoreError as exc:
            reasons.append(f"store: {exc}")
        try:
            await app[UPSTREAM].probe(app[CONFIG].observability.readiness_max_age_seconds)
        except UpstreamError as exc:
            reasons.append(f"upstream: {exc.message}")
    if reasons:
        log.warning("not_ready", reasons=reasons)
        return web.json_response({"status": "unavailable", "reasons": reasons}, status=503)
    return web.json_response({"status": "ready"})


async def metrics_endpoint(request: web.Request) -> web.Response:
    """Prometheus text; the store-derived gauges are read at scrape time."""
    metrics = request.app[METRICS]
    store = request.app[STORE]
    try:
        counts = await store.stats()
        size = await store.size_bytes()
    except StoreError as exc:
        log.warning("metrics_store_unreadable", error=str(exc))
    else:
        for status, count in counts.items():
            if status != "records":
                metrics.tasks_by_status.labels(status).set(count)
        metrics.store_bytes.set(size)
    return web.Response(body=metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})


def create_app(config: Config) -> web.Application:
    app = web.Application(
        client_max_size=config.security.max_body_bytes,
        middlewares=[error_edge, admission],
    )
    app[CONFIG] = config
    app[STOPPING] = []
    app.cleanup_ctx.append(upstream_ctx)
    app.on_shutdown.append(end_listen_streams)
    app.router.add_route("*", config.listen.path, handle_mcp)
    app.router.add_get(HEALTHZ, healthz)
    app.router.add_get(READYZ, readyz)
    if config.observability.metrics:
        app[METRICS] = Metrics(named_tools(config.tasks))
        app.router.add_get(METRICS_PATH, metrics_endpoint)
    return app
