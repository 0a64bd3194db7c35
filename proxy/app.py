"""The aiohttp application: routes, admission, classification, lifecycle, health and metrics.

One endpoint serves both eras: each POST is classified (docs/architecture.md), legacy traffic goes to the
pass-through, modern requests to `Front`. A legacy POST is read as JSON only when something needs what it
says (its method for the metrics and the request log line, its trace context, its id while draining); else
it is relayed unread, its bytes having shown that it cannot be modern. Every ProxyError raised anywhere below
becomes an answer in one place, the error edge (`edge.py`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import AbstractContextManager
from typing import Final

import aiohttp
import structlog
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST
from yarl import URL

from proxy import tracing
from proxy.admin import Admin
from proxy.audit import subject
from proxy.config import Config
from proxy.drain import DRAIN, Drain, drainz, track
from proxy.edge import (
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
from proxy.errors import (
    BodyTimeoutError,
    ForbiddenError,
    InvalidRequestError,
    MethodNotAllowedError,
    ParseError,
    PayloadTooLargeError,
    ProxyError,
    TaskStoreUnavailableError,
    UnauthorizedError,
    UpstreamError,
)
from proxy.front import Front
from proxy.jwt_identity import JwtIdentity
from proxy.legacy import LegacyFront
from proxy.legacy.serving import legacy_front
from proxy.live_config import LiveConfig
from proxy.observability import Metrics, logs_at
from proxy.policy import named_tools
from proxy.principals import Principals, deployment_key
from proxy.relay import OriginRelay
from proxy.startup import is_loopback
from proxy.tasks.push import TaskWatchers
from proxy.tasks.runner import TaskRunner
from proxy.tasks.store import StoreError, StoreUnavailableError, TaskStore, open_store
from proxy.upstream.http.link import upstream_connector
from proxy.upstream.kinds import session_kind
from proxy.upstream.pool import SessionPool
from proxy.wire import jsonrpc
from proxy.wire.envelope import Caller, is_modern, may_carry_version_key, validate_modern
from proxy.wire.jsonrpc import Notification, Response

log = structlog.get_logger(__name__)

CONFIG: Final = web.AppKey("config", Config)  # as started: what a reload cannot change is read here
LIVE: Final = web.AppKey("live", LiveConfig)  # the config in force: what may change live is read through it
FRONT: Final = web.AppKey("front", Front)
PASSTHROUGH: Final = web.AppKey("passthrough", LegacyFront)
RELAY: Final = web.AppKey("relay", OriginRelay)
JWT: Final = web.AppKey("jwt", JwtIdentity)
UPSTREAM: Final = web.AppKey("upstream", SessionPool)
STORE: Final = web.AppKey("store", TaskStore)
RUNNER: Final = web.AppKey("runner", TaskRunner)
STOPPING: Final = web.AppKey("stopping", list[bool])
ADMIN: Final = web.AppKey("admin", Admin)  # the operators' listener, when `admin.port` is set
READY_STORE_SECONDS: Final = 2.0  # /readyz: a store that takes longer to commit a write counts as down


def _host_name(host: str) -> str:
    host = host.strip().lower()
    if host.startswith("["):
        end = host.find("]")
        return host[: end + 1] if end > 0 else host
    name, _, _ = host.partition(":")
    return name


def _name_allowed(name: str, allowed_hosts: list[str]) -> bool:
    """`name` (lower case, no port) is one of the allowed hosts, where a `*` label stands for one label."""
    labels: list[str] | None = None
    for pattern in allowed_hosts:
        pattern = pattern.lower()
        if "*" not in pattern:
            if name == pattern:
                return True
            continue
        labels = labels if labels is not None else name.split(".")
        wanted = pattern.split(".")
        if len(labels) == len(wanted) and all(
            label == want or (want == "*" and label != "") for label, want in zip(labels, wanted, strict=True)
        ):
            return True
    return False


def host_allowed(host: str | None, allowed_hosts: list[str]) -> bool:
    return host is not None and _name_allowed(_host_name(host), allowed_hosts)


def origin_allowed(origin: str, allowed_hosts: list[str], allowed_origins: list[str]) -> bool:
    if origin in allowed_origins:
        return True
    url = URL(origin)
    if url.scheme not in ("http", "https") or url.raw_host is None:
        return False
    host = url.raw_host.lower()
    if ":" in host:  # IPv6 literal
        host = f"[{host}]"
    return _name_allowed(host, allowed_hosts)


def not_utf8_header(headers: Mapping[str, str]) -> str | None:
    """The name of a header whose value is not UTF-8, if any. HTTP allows any byte from 0x80 up in a value, and
    aiohttp keeps such bytes as surrogate escapes; neither the upstream request nor a hash of the principal can
    carry them unchanged, so the request is refused rather than passed on altered."""
    for name, value in headers.items():
        if not value.isascii():
            try:
                value.encode()
            except UnicodeEncodeError:
                return name
    return None


SHOWN_HOST_CHARS: Final = 253  # of a refused Host header in the 403's message (the longest DNS name)


def host_refusal(host: str | None) -> str:
    """The 403's message for a Host not allowed: the Host it got (printable ASCII only, at most SHOWN_HOST_CHARS;
    anything else is replaced by `?`, so the message is always a plain JSON string) and the key that allows it."""
    if host is None:
        return "Forbidden: the request has no Host header (security.allowed_hosts lists the Host values served)"
    shown = "".join(char if " " <= char <= "~" else "?" for char in host[:SHOWN_HOST_CHARS])
    more = "…" if len(host) > SHOWN_HOST_CHARS else ""
    return f"Forbidden: Host header not allowed: {shown!r}{more}; add its name to security.allowed_hosts to serve it"


@web.middleware
async def admission(request: web.Request, handler: Handler) -> web.StreamResponse:
    if request.method == "GET" and request.path in OPS_PATHS:
        return await handler(request)
    refusal = _refusal(request)
    if refusal is None:
        return await handler(request)
    if tracing.enabled():  # refused before anything was read: its SERVER span names the error
        with _server_span(request, None, "modern" if is_modern(request.headers, None) else "legacy", None):
            raise refusal
    raise refusal


def _refusal(request: web.Request) -> ProxyError | None:
    """Why the request is refused before it is read (a header that is not UTF-8, a Host or Origin not allowed)."""
    if (name := not_utf8_header(request.headers)) is not None:
        return InvalidRequestError(f"Invalid Request: the value of the {name} header is not UTF-8")
    security = request.app[LIVE].current.security
    host = request.headers.get("Host")
    if not host_allowed(host, security.allowed_hosts):
        return ForbiddenError(host_refusal(host))
    origin = request.headers.get("Origin")
    if origin is not None and not origin_allowed(origin, security.allowed_hosts, security.allowed_origins):
        return ForbiddenError("Forbidden: Origin not allowed")
    return None


@web.middleware
async def relay_unrouted(request: web.Request, handler: Handler) -> web.StreamResponse:
    """A path no route of the proxy's own serves goes to the upstream's origin (`relay.py`); a path the proxy
    serves with another method keeps its 405."""
    if not isinstance(request.match_info.http_exception, web.HTTPNotFound) or RELAY not in request.app:
        return await handler(request)
    if request.path in OPS_PATHS:  # e.g. /metrics switched off: still the proxy's (and exempt from the Host check)
        return await handler(request)
    request[ERA] = "relayed"
    arrived = time.time_ns() if tracing.enabled() else None
    with _server_span(request, None, "relayed", arrived) as span:
        body = await _read_body(request) if request.body_exists else None
        response = await request.app[RELAY].relay(request, body)
        span.status(response.status)
        return response


# --- the MCP endpoint ---------------------------------------------------------------------------------


async def _read_body(request: web.Request) -> bytes:
    """The whole body, within `security.body_read_timeout_seconds` (both eras: legacy bodies are read before they
    are relayed) and `security.max_body_bytes`."""
    security = request.app[LIVE].current.security
    try:
        if request.content.is_eof():  # all of it came with the headers (most bodies): nothing to wait for
            return await request.read()
        async with asyncio.timeout(security.body_read_timeout_seconds):
            return await request.read()
    except TimeoutError:
        raise BodyTimeoutError(f"Request body not received within {security.body_read_timeout_seconds:g} s") from None
    except web.HTTPRequestEntityTooLarge:
        raise PayloadTooLargeError(f"Request body too large (limit {security.max_body_bytes} bytes)") from None


async def handle_mcp(request: web.Request) -> web.StreamResponse:
    """Every request gets its SERVER span, from its arrival here (its body read included), refused ones too."""
    arrived = time.time_ns() if tracing.enabled() else None
    if request.method != "POST":
        if request.method in ("GET", "DELETE") and is_modern(request.headers, None):
            # A modern client has no GET stream and no session to delete.
            request[ERA] = "modern"
            with _server_span(request, None, "modern", arrived):
                raise MethodNotAllowedError()
        request[ERA] = "legacy"
        return await _relay(request, None, None, arrived)
    try:
        body = await _read_body(request)
    except ProxyError:  # too large, or not in time: the era as the headers tell it
        with _server_span(request, None, "modern" if is_modern(request.headers, None) else "legacy", arrived):
            raise
    modern_header = is_modern(request.headers, None)
    if not modern_header and not may_carry_version_key(body):
        return await _legacy_post(request, body, None, arrived, decoded=False)  # legacy by its bytes: not decoded
    try:
        decoded = jsonrpc.loads(body)
    except ParseError:
        if modern_header:
            request[ERA] = "modern"
            with _server_span(request, None, "modern", arrived):
                raise
        return await _legacy_post(request, body, None, arrived, decoded=True)
    if not is_modern(request.headers, decoded):
        return await _legacy_post(request, body, decoded, arrived, decoded=True)
    request[ERA] = "modern"
    with _server_span(request, decoded, "modern", arrived):
        return await serve_modern(request, decoded)


def _server_span(
    request: web.Request, decoded: object, era: str, arrived: int | None
) -> AbstractContextManager[tracing.ServerSpan]:
    return tracing.server_span(
        request.headers, decoded, era=era, http_method=request.method, peer=request.remote, start_time=arrived
    )


def _reads_legacy_messages(request: web.Request) -> bool:
    """Whether anything needs what a legacy POST says (its method, id or trace context): the request metrics,
    the request log line, tracing, or a drain (which refuses a new session with the request's id)."""
    return METRICS in request.app or logs_at(logging.INFO) or tracing.enabled() or request.app[DRAIN].draining


async def _legacy_post(
    request: web.Request, body: bytes, message: object, arrived: int | None, *, decoded: bool
) -> web.StreamResponse:
    """A legacy client's POST, relayed as it came. Its body is read as JSON only when something needs what it
    says (`_reads_legacy_messages`); `decoded` tells whether `message` is that reading already (None for a body
    that is not JSON)."""
    request[ERA] = "legacy"
    if not decoded and _reads_legacy_messages(request):
        try:
            message = jsonrpc.loads(body)
        except ParseError:
            message = None  # relayed all the same: the upstream answers it
    if isinstance(message, dict) and isinstance(message.get("method"), str):
        request[MCP_METHOD] = message["method"]
    request.app[DRAIN].check_legacy(request, message)
    return await _relay(request, body, message, arrived)


async def _relay(request: web.Request, body: bytes | None, decoded: object, arrived: int | None) -> web.StreamResponse:
    """A legacy client's request, in its SERVER span."""
    with _server_span(request, decoded, "legacy", arrived) as span:
        response = await request.app[PASSTHROUGH].relay(request, body)
        span.status(response.status)
        return response


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
    audited = _audited(request, message.method, message.params) if request.app.get(AUDIT) is not None else None
    modern = validate_modern(request.headers, message.id, message.method, message.params)
    request.app[DRAIN].check_modern(modern)
    config = request.app[LIVE].current
    principal = request.headers.get(config.security.principal_header) or None  # empty counts as none
    if principal is None and config.security.anonymous == "refuse":
        raise UnauthorizedError(
            f"Unauthorized: this proxy serves no anonymous callers; send {config.security.principal_header}"
        )
    if principal is not None and JWT in request.app:
        principal = await request.app[JWT].credential(principal)  # a JWT that fails is refused here (401)
    caller = Caller(principal=principal, headers=request.headers)
    if audited is not None:
        audited.update(subject=subject(principal), principal=request.app[RUNNER].principals.key_of(principal) or None)
    channel = request[CHANNEL] = HttpChannel(request, config.limits.write_timeout_seconds)
    try:
        reply = await request.app[FRONT].dispatch(modern, caller, channel)
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


# --- lifecycle ---------------------------------------------------------------------------------------


async def upstream_ctx(app: web.Application) -> AsyncIterator[None]:
    config = app[CONFIG]
    # The store first: a database in use by another process stops the start before anything else is opened.
    store = await open_store(config.store, max_records=config.tasks.max_records)
    app[STORE] = store
    if config.store.url is None:
        log.info("store_opened", backend="sqlite", path=config.store.path)  # absolute (`parse_config`)
    else:
        log.info("store_opened", backend="postgresql")
    # No shared cookie jar: what the upstream sets is kept per upstream session (`upstream/http/session.py`).
    http = aiohttp.ClientSession(
        connector=upstream_connector(), auto_decompress=True, cookie_jar=aiohttp.DummyCookieJar()
    )
    metrics = app.get(METRICS)
    upstream = SessionPool(session_kind(config, http, metrics))
    app[UPSTREAM] = upstream
    live = app[LIVE]
    runner = TaskRunner(lambda: live.current, store, upstream, Principals(deployment_key(config)), metrics=metrics)
    app[RUNNER] = runner
    audit = runner.audit
    if audit is not None:
        app[AUDIT] = audit
        live.on_sighup(audit.reopen)  # a new file after a rotation
    if metrics is not None:
        metrics.tasks_running.set_function(lambda: runner.running)
        metrics.calls_parked.set_function(lambda: runner.parked)
        metrics.upstream_sessions.set_function(lambda: upstream.open_sessions)
        metrics.upstream_sessions_idle.set_function(lambda: upstream.idle_sessions)
        metrics.upstream_calls_in_flight.set_function(lambda: upstream.calls_in_flight)
        metrics.lease_held.set_function(lambda: runner.lease_problem() is None)
        metrics.store_available.set_function(lambda: store.health.available)
        store.health.listener = metrics.store_operation_failed
    watchers = TaskWatchers(store)
    runner.spawn(watchers.run(), "task-feed")
    front = app[FRONT] = Front(lambda: live.current, upstream, runner, watchers)
    if metrics is not None:
        metrics.listen_streams.set_function(lambda: front.listens.open_streams)
    drain = app[DRAIN]
    drain.open_calls = lambda: runner.open_calls
    runner.follow_drain(lambda: drain.draining)
    live.subscribe(lambda new: runner.config_swapped())  # the queue admits by the caps now in force
    legacy = app[PASSTHROUGH] = legacy_front(upstream)  # relayed, or served by the proxy (the kind decides)
    app[RELAY] = OriginRelay.of(config.relay, legacy)  # other paths: to the upstream's origin, when it has one
    admin = Admin(config.admin, store, runner.clock) if config.admin.port is not None else None
    try:
        await runner.start()  # restart recovery happens before the first request is served
        if admin is not None:
            await admin.start()
            app[ADMIN] = admin
        upstream.warm_up()
        yield
    finally:
        if admin is not None:
            await admin.stop()
        await runner.close()
        await store.close()
        await legacy.close()
        await upstream.close()
        await http.close()


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
    """Readiness: the task store takes a committed write, this replica holds its lease on the store, and the
    upstream answered recently (else a fresh `initialize` must succeed). 503 with the reasons otherwise."""
    app = request.app
    reasons: list[str] = []
    if app[DRAIN].draining:
        reasons.append("draining")
    elif app[STOPPING]:
        reasons.append("shutting down")
    else:
        try:
            async with asyncio.timeout(READY_STORE_SECONDS):
                await app[STORE].check_writable(app[RUNNER].clock())
        except StoreError as exc:
            reasons.append(f"store: {exc}")
        except TimeoutError:
            reasons.append(f"store: no committed write within {READY_STORE_SECONDS:g} s")
        lease = app[RUNNER].lease_problem()
        if lease is not None:
            reasons.append(f"lease: {lease}")
        try:
            await app[UPSTREAM].probe(app[LIVE].current.observability.readiness_max_age_seconds)
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
    started = time.perf_counter()
    try:
        counts = await store.stats()
        size = await store.size_bytes()
    except StoreError as exc:
        log.warning("metrics_store_unreadable", error=str(exc))
        metrics.store_up.set(0)
    else:
        metrics.store_up.set(1)
        for status, count in counts.items():
            if status != "records":
                metrics.tasks_by_status.labels(status).set(count)
        metrics.store_bytes.set(size)
    metrics.store_read_seconds.set(time.perf_counter() - started)
    return web.Response(body=metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})


def create_app(config: Config, live: LiveConfig | None = None) -> web.Application:
    """The app for `config`; `live` is the holder reloads swap (a fresh one, with no file, when not given)."""
    live = live if live is not None else LiveConfig(config)
    drain = Drain(live, config.listen.path)
    if config.security.anonymous == "allow" and not is_loopback(config.listen.host):
        log.warning(
            "anonymous_callers_allowed",
            host=config.listen.host,
            principal_header=config.security.principal_header,
            hint="requests without the principal header share one anonymous identity; set security.anonymous: "
            "refuse unless a trusted hop always sets the header",
        )
    app = web.Application(
        client_max_size=config.security.max_body_bytes,
        middlewares=[error_edge, track(drain), admission, relay_unrouted],
    )
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
    app.router.add_route("*", config.listen.path, handle_mcp)
    app.router.add_get(HEALTHZ, healthz)
    app.router.add_get(READYZ, readyz)
    app.router.add_get(DRAINZ, drainz)
    if config.observability.metrics:
        metrics = app[METRICS] = Metrics(named_tools(config.tasks))
        drain.register_metrics(metrics.registry)
        live.register_metrics(metrics.registry)
        app.router.add_get(METRICS_PATH, metrics_endpoint)
    return app
